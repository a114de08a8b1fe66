"""Moving small host arrays to the device and results back without making the host wait for the GPU.

Uploads go through pinned memory with a non-blocking copy (torch's pinned allocator keeps a block
until the copies reading it have run, so a block is never refilled under a pending copy). A step's
results are packed into one device tensor and copied non-blocking into pinned memory, with an event
recorded after the copy: whoever reads them (the actor, when it records the step) waits on the event,
not the thread that launched the step. On CPU nothing is copied and nothing waits.
"""
from __future__ import annotations

import numpy as np
import torch


def upload(values, device: torch.device, dtype: np.dtype | None = None) -> torch.Tensor:
    """Host values (array-like) as a tensor on `device`: as they are on CPU, else pinned and copied non-blocking."""
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=dtype))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class ReadBack:
    """Device tensors of one step, read back with one copy: `add` them, `start` the copy, `values` after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[torch.Tensor] = []
        self._spans: list[tuple[int, int]] = []
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        self._values: list | None = None

    def add(self, tensor: torch.Tensor) -> int:
        """Queue `tensor` (any shape, values exact in float64) for the copy; returns its slot."""
        start = self._spans[-1][1] if self._spans else 0
        self._parts.append(tensor.reshape(-1).double())
        self._spans.append((start, start + tensor.numel()))
        return len(self._spans) - 1

    def start(self) -> None:
        """Start the copy (non-blocking into pinned memory on CUDA) and record the event it completes."""
        packed = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts) if self._parts else \
            torch.zeros(0, dtype=torch.float64, device=self.device)
        self._parts = []
        if self.device.type == "cpu":
            self._host = packed
            return
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._host.copy_(packed, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> None:
        """Block until the copy has landed (the read-back point; never inside a step)."""
        if self._values is None:
            if self._done is not None:
                self._done.synchronize()
            self._values = self._host.tolist()

    def values(self, slot: int) -> list:
        """The values added as `slot`, flattened, as Python floats (after `wait`)."""
        start, stop = self._spans[slot]
        return self._values[start:stop]
