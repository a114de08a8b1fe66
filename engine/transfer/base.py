"""KV block transfer between two block-major pools: coalesced runs, torch backend, backend choice.

pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous, so a run of
consecutive block ids is one contiguous memory range and moves in one copy.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Protocol, Sequence

import torch

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "cupy-p2p")


class TransferUnavailable(RuntimeError):
    """A KV transfer backend cannot work here; the message says why."""


class TransferHandle:
    """One started copy of KV blocks.

    `done()` polls without blocking, `wait()` blocks until the copy is complete, and
    `seconds` is the measured duration once done (CUDA event time or CPU wall time), else None.
    """

    __slots__ = ("nbytes", "_start", "_end", "_seconds")

    def __init__(self, nbytes: int, start=None, end=None, seconds: float | None = None):
        self.nbytes = nbytes
        self._start = start      # torch.cuda.Event | None
        self._end = end          # torch.cuda.Event | None
        self._seconds = seconds

    @classmethod
    def finished(cls, nbytes: int, seconds: float) -> TransferHandle:
        return cls(nbytes, seconds=seconds)

    @classmethod
    def pending(cls, nbytes: int, start: torch.cuda.Event, end: torch.cuda.Event) -> TransferHandle:
        return cls(nbytes, start, end)

    def done(self) -> bool:
        return self._end is None or self._end.query()

    def wait(self) -> None:
        if self._end is not None:
            self._end.synchronize()

    @property
    def seconds(self) -> float | None:
        if self._seconds is None and self._end is not None and self._end.query():
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds


class KVTransfer(Protocol):
    """Copies blocks of one KV pool into another; returns at once with a handle on the copy.

    `copy_blocks` raises ValueError when the pools' geometry or the block ids do not fit.
    """

    name: str

    def copy_blocks(
        self,
        src_pool: torch.Tensor,
        dst_pool: torch.Tensor,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle: ...


def coalesce_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group (src, dst) block pairs into (src_start, dst_start, length) runs consecutive on both sides.

    Runs keep the input order; raises ValueError when the two lists differ in length.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination block ids")
    runs: list[list[int]] = []
    for src, dst in zip(src_ids, dst_ids):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(src, dst, length) for src, dst, length in runs]


def check_copy(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> None:
    """Raise ValueError unless the pools share block geometry and dtype and the ids fit them."""
    if src_pool.dim() < 2 or src_pool.shape[1:] != dst_pool.shape[1:]:
        raise ValueError(f"pool block geometry differs: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}")
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"pool dtypes differ: {src_pool.dtype} vs {dst_pool.dtype}")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination block ids")
    _check_ids("source", src_ids, src_pool.shape[0])
    _check_ids("destination", dst_ids, dst_pool.shape[0])
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("destination block ids repeat")


def _check_ids(side: str, ids: Sequence[int], num_blocks: int) -> None:
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} out of range [0, {num_blocks})")


def block_nbytes(pool: torch.Tensor) -> int:
    return math.prod(pool.shape[1:]) * pool.element_size()


def timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    # NOTE: a blocking end event lets wait() sleep instead of spinning a CPU core.
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)


def copy_runs(src_pool: torch.Tensor, dst_pool: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    for src, dst, length in runs:
        dst_pool[dst:dst + length].copy_(src_pool[src:src + length], non_blocking=True)


class TorchTransfer:
    """`copy_` per coalesced run; on CUDA on a transfer stream per device that waits on the caller's stream."""

    name = "torch"

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy_blocks(
        self,
        src_pool: torch.Tensor,
        dst_pool: torch.Tensor,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        check_copy(src_pool, dst_pool, src_block_ids, dst_block_ids)
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        nbytes = len(src_block_ids) * block_nbytes(src_pool)
        device = _stream_device(src_pool.device, dst_pool.device)
        if device is None or not runs:
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


def select_transfer(
    src_device: torch.device, dst_device: torch.device, forced: str | None = None
) -> KVTransfer:
    """Pick the KV transfer backend for copies from `src_device` to `dst_device`.

    Without `forced`: "cupy-p2p" between two CUDA devices when CuPy, CUDA and peer access all
    work, else "torch". Raises ValueError for an unknown `forced` name and TransferUnavailable
    (with the reason) when the forced backend cannot work here.
    """
    src, dst = torch.device(src_device), torch.device(dst_device)
    if forced is not None and forced not in BACKEND_NAMES:
        raise ValueError(f"unknown KV transfer backend {forced!r}; valid: {', '.join(BACKEND_NAMES)}")
    if forced == "torch" or (forced is None and not _two_cuda_devices(src, dst)):
        return TorchTransfer()
    from engine.transfer.cupy_p2p import make_cupy_p2p

    if forced == "cupy-p2p":
        return make_cupy_p2p(src, dst)
    try:
        return make_cupy_p2p(src, dst)
    except TransferUnavailable as exc:
        logger.info("KV transfer %s -> %s falls back to torch: %s", src, dst, exc)
        return TorchTransfer()


def _two_cuda_devices(src: torch.device, dst: torch.device) -> bool:
    return src.type == "cuda" and dst.type == "cuda" and src != dst
