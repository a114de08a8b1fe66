"""Tier copies of a GPU runner. A save's block goes to pinned host memory on a side stream that the step's
stream then waits for (an event): the forward cannot overwrite the block first, and the host never waits at
launch; its bytes are summed and written to the tiers after the step (`TierCopies.finish`, on the thread that
reads the step's tokens back). A load is read and checked in pinned host memory, then copied to the device on
the step's stream, ahead of its forward. Pinned buffers come from torch's caching host allocator, which keeps
a buffer until the copies that read it have run."""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdserve.engine.core.kv_tiers import TierCopy
from pdserve.engine.worker.tiers.copier import PoolOf, TierCopier, TierCopies, TierOutcome


def block_bytes_of(pool: torch.Tensor, block: int) -> torch.Tensor:
    """Block `block` of a pool, as flat uint8 (a view)."""
    return pool[block].reshape(-1).view(torch.uint8)


class CudaTierCopier(TierCopier):
    def __init__(self, tiers: Sequence, device: torch.device) -> None:
        super().__init__(tiers)
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)

    def start(self, saves: Sequence[TierCopy], loads: Sequence[TierCopy], pool_of: PoolOf) -> TierCopies:
        staged, done = self._to_host(saves, pool_of)
        started = time.perf_counter()
        bad = tuple(i for i, load in enumerate(loads) if not self._load(load, pool_of(load.peer)))
        outcome = TierOutcome(bad, (), time.perf_counter() - started)
        return TierCopies(outcome, lambda: self._write(saves, staged, done))

    def _to_host(self, saves: Sequence[TierCopy], pool_of: PoolOf) -> tuple[dict, torch.cuda.Event | None]:
        """Each saved block in pinned host memory, copied on the side stream; the step's stream waits for it."""
        if not saves:
            return {}, None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        staged = {}
        with torch.cuda.stream(self._stream):
            for save in saves:
                where = (save.peer, save.block)
                if where in staged:
                    continue
                source = block_bytes_of(pool_of(save.peer), save.block)
                host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
                on_own_device = source.device == self.device
                host.copy_(source, non_blocking=on_own_device)   # NOTE: a peer GPU's block: copied at once
                staged[where] = host
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)
        return staged, done

    def _write(self, saves: Sequence[TierCopy], staged: dict, done: torch.cuda.Event | None) -> tuple[int, ...]:
        if done is None:
            return ()
        done.synchronize()
        return self.write(saves, [staged[(s.peer, s.block)].numpy() for s in saves])

    def _load(self, load: TierCopy, pool: torch.Tensor) -> bool:
        target = block_bytes_of(pool, load.block)
        host = torch.empty(target.numel(), dtype=torch.uint8, pin_memory=True)
        if not self.tiers[load.tier].read_into(load.slot, load.digest, host.numpy()):
            return False
        target.copy_(host, non_blocking=True)               # on the step's stream: before its forward
        return True


def tier_copier(tiers: Sequence, device: torch.device) -> TierCopier:
    """The copier for a runner on `device`."""
    return CudaTierCopier(tiers, device) if torch.device(device).type == "cuda" else TierCopier(tiers)
