"""What every KV transfer backend shares: the copy handle, the `copy_blocks` template, coalesced runs, checks.

Pools are laid out as `pdserve.kernels.kv_layout.KVLayout` says: a run of consecutive block ids is one
contiguous memory range and moves in one copy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Sequence

import torch

from pdserve.kernels.kv_layout import KVLayout


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


def first_pending(transfers: Iterable[TransferHandle]):
    """The copy an idle actor waits for: the first not landed, else the first landed one (it landed after
    schedule() and still needs acting on), else None."""
    tracked = list(transfers)
    return next((t for t in tracked if not t.done()), tracked[0] if tracked else None)


class KVTransfer(ABC):
    """Copies blocks of one KV pool into another; `copy_blocks` returns at once with a handle on the copy.

    `copy_blocks` checks the pools and the ids (ValueError when the geometry or the ids do not fit), coalesces
    the block runs and hands them to `_copy_runs`, the one part each backend writes."""

    name: str

    def copy_blocks(
        self,
        src_pool: torch.Tensor,
        dst_pool: torch.Tensor,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        check_copy(src_pool, dst_pool, src_block_ids, dst_block_ids)
        self._check_pools(src_pool, dst_pool)
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        if not runs:
            return TransferHandle.finished(0, 0.0)
        return self._copy_runs(src_pool, dst_pool, runs, block_nbytes(src_pool))

    def _check_pools(self, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
        """Raise ValueError where this backend cannot copy between these two pools (any two, by default)."""

    @abstractmethod
    def _copy_runs(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, runs: list[tuple[int, int, int]],
                   block_bytes: int) -> TransferHandle:
        """Start copying the (src_start, dst_start, length) runs, `block_bytes` a block; the handle on it."""


def run_bytes(runs: list[tuple[int, int, int]], block_bytes: int) -> int:
    """The bytes `runs` move."""
    return sum(length for _, _, length in runs) * block_bytes


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
    if _layout_or_none(src_pool) is None or _layout_or_none(src_pool) != _layout_or_none(dst_pool):
        raise ValueError(f"pool block geometry differs: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}")
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"pool dtypes differ: {src_pool.dtype} vs {dst_pool.dtype}")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination block ids")
    _check_ids("source", src_ids, KVLayout.num_blocks(src_pool))
    _check_ids("destination", dst_ids, KVLayout.num_blocks(dst_pool))
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("destination block ids repeat")


def _check_ids(side: str, ids: Sequence[int], num_blocks: int) -> None:
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} out of range [0, {num_blocks})")


def _layout_or_none(pool: torch.Tensor) -> KVLayout | None:
    try:
        return KVLayout.of(pool)
    except ValueError:
        return None


def block_nbytes(pool: torch.Tensor) -> int:
    return KVLayout.of(pool).block_bytes(pool.dtype)


def timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    # NOTE: a blocking end event lets wait() sleep instead of spinning a CPU core.
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)
