"""The "cuda-ipc" pool sharing: a KV pool in GPU memory that other processes open with a CUDA IPC handle.

For `--workers process` on GPUs (the CPU counterpart is the memfd segment of
`pdserve.engine.worker.processes.shared_pool`): the coordinator allocates each decode pool on its
device and exports the allocation as a CUDA IPC memory handle (torch's CUDA storage sharing, the
`torch.multiprocessing` reduction: `cudaIpcGetMemHandle` and a reference count the consumers hold);
the decode worker opens it as its own pool and every prefill worker opens it as a peer pool and
copies finished blocks straight into it. The coordinator keeps the allocation for as long as it
runs, so a worker spawned again opens the same pool. Where a handle cannot be exported or opened (no
CUDA in a process, a platform without CUDA IPC, a device the opener cannot see, the driver
refusing) it is refused with `CudaIpcUnavailable`, naming the device, the process and CUDA's reason.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing import reductions

from pdserve.engine.transfer.base import TransferUnavailable

NAME = "cuda-ipc"


class CudaIpcUnavailable(TransferUnavailable):
    """A pool cannot be shared (or opened) through CUDA IPC here; the message says why."""


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """What another process needs to open a pool: picklable, sent to a worker at spawn."""

    device: str                       # cuda:N, as the exporting process numbers its devices
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner_pid: int
    rebuild: Callable                 # torch's rebuild function for the exported storage, and its arguments
    args: tuple

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def open(self) -> torch.Tensor:
        """The pool, mapped into this process (the exporter gets its own tensor back: CUDA cannot open a
        handle in the process that made it). Raises CudaIpcUnavailable with the reason."""
        if os.getpid() == self.owner_pid:
            raise CudaIpcUnavailable(f"the {self.device} pool's CUDA IPC handle is opened in the process that "
                                     f"exported it (pid {self.owner_pid}); use the pool itself there")
        index = torch.device(self.device).index
        if not torch.cuda.is_available():
            raise CudaIpcUnavailable(f"cannot open the {self.device} pool's CUDA IPC handle in process "
                                     f"{os.getpid()}: CUDA is not available here")
        if index >= torch.cuda.device_count():
            raise CudaIpcUnavailable(f"cannot open the {self.device} pool's CUDA IPC handle in process "
                                     f"{os.getpid()}: it sees {torch.cuda.device_count()} CUDA device(s) "
                                     f"(CUDA_VISIBLE_DEVICES must match the exporting process's)")
        try:
            tensor = self.rebuild(*self.args)
        except (RuntimeError, OSError) as e:
            raise CudaIpcUnavailable(f"cannot open the {self.device} pool's CUDA IPC handle in process "
                                     f"{os.getpid()}: {e}") from e
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"the CUDA IPC pool opened as {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {self.shape} {self.dtype}")
        return tensor


class CudaIpcPool:
    """A pool allocated in this process (the coordinator) and exported for worker processes to open."""

    name = NAME

    def __init__(self, tensor: torch.Tensor, handle: CudaIpcHandle) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.handle = handle

    @property
    def ticket(self) -> CudaIpcHandle:
        """What a worker is handed to open the pool."""
        return self.handle

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> CudaIpcPool:
        """Allocate a zeroed pool of `shape` on `device` and export it; CudaIpcUnavailable with the reason if
        it cannot be shared (ValueError for a device that is not CUDA)."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC shares CUDA memory; {device} is not a CUDA device")
        if not torch.cuda.is_available():
            raise CudaIpcUnavailable(f"cannot share a KV pool on {device} through CUDA IPC: CUDA is not available")
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        try:
            rebuild, args = reductions.reduce_tensor(tensor)
        except (RuntimeError, OSError) as e:
            raise CudaIpcUnavailable(f"cannot export the KV pool on {device} as a CUDA IPC handle: {e}") from e
        name = f"cuda:{tensor.get_device()}"
        return cls(tensor, CudaIpcHandle(name, tuple(shape), dtype, os.getpid(), rebuild, args))

    def close(self) -> None:
        """Drop this process's reference (the memory goes once no worker holds it open either)."""
        self.tensor = None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty(0, dtype=dtype).element_size()
