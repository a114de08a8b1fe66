"""The "staged" KV transfer backend: GPU -> pinned host memory -> GPU, for two GPUs that are not peers.

Block runs are cut into pieces that fit one of two pinned host slots. A piece is copied into a slot on
a stream of the source device, and out of it on a stream of the destination device once that copy
is done; the other slot fills meanwhile, and a slot is refilled only after its last piece has left.
"""
from __future__ import annotations

import torch

from pdserve.engine.transfer.base import KVTransfer, TransferHandle, TransferUnavailable, run_bytes, timing_events
from pdserve.kernels.kv_layout import KVLayout

SLOT_BYTES = 32 << 20
NUM_SLOTS = 2


def staging_pieces(runs: list[tuple[int, int, int]], blocks_per_piece: int) -> list[tuple[int, int, int]]:
    """Cut (src_start, dst_start, length) runs into runs of at most `blocks_per_piece` blocks, in order."""
    pieces = []
    for src, dst, length in runs:
        for offset in range(0, length, blocks_per_piece):
            pieces.append((src + offset, dst + offset, min(blocks_per_piece, length - offset)))
    return pieces


def block_bytes_view(pool: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Blocks first .. first + count - 1 of a contiguous pool as one flat uint8 tensor."""
    return KVLayout.block_view(pool, first, count).reshape(-1).view(torch.uint8)


class StagedTransfer(KVTransfer):
    """Copies blocks between any two CUDA devices through two pinned host slots; never needs peer access.

    The source stream first waits on the caller's current stream of the source device. The handle's
    events are both on the destination device (its stream starts when the source stream does)."""

    name = "staged"

    def __init__(self, src_device: torch.device, dst_device: torch.device, slot_bytes: int = SLOT_BYTES):
        self._src, self._dst = _indexed(src_device), _indexed(dst_device)
        self._src_stream = torch.cuda.Stream(device=self._src)
        self._dst_stream = torch.cuda.Stream(device=self._dst)
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(NUM_SLOTS)]
        self._filled: list = [None] * NUM_SLOTS     # event on the source stream: the slot holds a piece
        self._drained: list = [None] * NUM_SLOTS    # event on the destination stream: the piece has left

    def _check_pools(self, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
        if src_pool.device != self._src or dst_pool.device != self._dst or not (
                src_pool.is_contiguous() and dst_pool.is_contiguous()):
            raise ValueError(f"staged copies need contiguous pools on {self._src} -> {self._dst}, got "
                             f"{src_pool.device} -> {dst_pool.device}")

    def _copy_runs(self, src_pool, dst_pool, runs, block_bytes) -> TransferHandle:
        self._fit(block_bytes)
        start, end = self._begin()
        pieces = staging_pieces(runs, self._slots[0].numel() // block_bytes)
        for index, (src, dst, count) in enumerate(pieces):
            slot = index % NUM_SLOTS
            self._to_host(block_bytes_view(src_pool, src, count), slot)
            self._to_device(slot, block_bytes_view(dst_pool, dst, count))
        end.record(self._dst_stream)
        return TransferHandle.pending(run_bytes(runs, block_bytes), start, end)

    def _fit(self, block_bytes: int) -> None:
        if self._slots[0].numel() < block_bytes:        # NOTE: only for blocks larger than SLOT_BYTES
            for stream in (self._src_stream, self._dst_stream):
                stream.synchronize()
            self._slots = [torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(NUM_SLOTS)]

    def _begin(self):
        self._src_stream.wait_stream(torch.cuda.current_stream(self._src))
        ready = torch.cuda.Event()
        ready.record(self._src_stream)
        self._dst_stream.wait_event(ready)
        start, end = timing_events()
        start.record(self._dst_stream)
        return start, end

    def _to_host(self, source: torch.Tensor, slot: int) -> None:
        if self._drained[slot] is not None:
            self._src_stream.wait_event(self._drained[slot])
        with torch.cuda.stream(self._src_stream):
            self._slots[slot][:source.numel()].copy_(source, non_blocking=True)
        self._filled[slot] = self._record(self._src_stream)

    def _to_device(self, slot: int, target: torch.Tensor) -> None:
        self._dst_stream.wait_event(self._filled[slot])
        with torch.cuda.stream(self._dst_stream):
            target.copy_(self._slots[slot][:target.numel()], non_blocking=True)
        self._drained[slot] = self._record(self._dst_stream)

    @staticmethod
    def _record(stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event


def make_staged(src: torch.device, dst: torch.device) -> StagedTransfer:
    """A staged backend between two CUDA devices; TransferUnavailable for any other pair."""
    if torch.device(src).type != "cuda" or torch.device(dst).type != "cuda":
        raise TransferUnavailable(f"staged copies run between CUDA devices, got {src} and {dst}")
    return StagedTransfer(src, dst)


def _indexed(device: torch.device) -> torch.device:
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
