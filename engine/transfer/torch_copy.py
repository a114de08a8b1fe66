"""The "torch" KV transfer backend: `copy_` per coalesced block run (CPU, same device, or any fallback)."""
from __future__ import annotations

import time
import torch

from pdserve.engine.transfer.base import KVTransfer, TransferHandle, run_bytes, timing_events
from pdserve.kernels.kv_layout import KVLayout


def copy_runs(src_pool: torch.Tensor, dst_pool: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    for src, dst, length in runs:
        KVLayout.block_view(dst_pool, dst, length).copy_(KVLayout.block_view(src_pool, src, length),
                                                          non_blocking=True)


class TorchTransfer(KVTransfer):
    """`copy_` per coalesced run; on CUDA on a transfer stream per device that waits on the caller's stream."""

    name = "torch"

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _copy_runs(self, src_pool, dst_pool, runs, block_bytes) -> TransferHandle:
        nbytes = run_bytes(runs, block_bytes)
        device = _stream_device(src_pool.device, dst_pool.device)
        if device is None:
            return _copy_now(src_pool, dst_pool, runs, nbytes)
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        start, end = timing_events()
        with torch.cuda.stream(stream):
            start.record(stream)
            copy_runs(src_pool, dst_pool, runs)
            end.record(stream)
        return TransferHandle.pending(nbytes, start, end)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def _stream_device(src: torch.device, dst: torch.device) -> torch.device | None:
    """The CUDA device whose stream carries the copy (the source's when it is CUDA); None on CPU."""
    if src.type == "cuda":
        return src
    return dst if dst.type == "cuda" else None


def _copy_now(src_pool, dst_pool, runs, nbytes: int) -> TransferHandle:
    start = time.perf_counter()
    copy_runs(src_pool, dst_pool, runs)
    return TransferHandle.finished(nbytes, time.perf_counter() - start)
