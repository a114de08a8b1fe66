"""A runner's copies between KV pools and the tiers, before its step's forward: saves first (a block leaving
the pool is written down before the step can overwrite it), then loads (a block is in the pool before the step
reads it). Each tier checks what it hands back (`records`); a block that fails is reported, never trusted.

On CPU everything happens at `start`; `TierCopies.finish` only returns the outcome. The CUDA copier
(`cuda_copier.py`) moves the bytes on streams and finishes the saves after the step (`finish`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from pdserve.engine.core.kv_tiers import TierCopy
from pdserve.engine.worker.tiers.records import checksum

logger = logging.getLogger(__name__)

PoolOf = Callable[[int], torch.Tensor]      # TierCopy.peer -> the pool its block is in


class TierOutcome(NamedTuple):
    """What a step's tier copies came to: loads whose block failed its check, saves that could not be
    written (both by index into the step's copies), and the seconds its loads took."""

    bad_loads: tuple[int, ...] = ()
    failed_saves: tuple[int, ...] = ()
    load_seconds: float = 0.0


class TierCopies:
    """A step's tier copies, started; `finish()` (after the step) completes them and says how they went."""

    def __init__(self, outcome: TierOutcome, finish: Callable[[], tuple[int, ...]] | None = None) -> None:
        self._outcome, self._finish = outcome, finish

    def finish(self) -> TierOutcome:
        if self._finish is not None:
            self._outcome = self._outcome._replace(failed_saves=self._finish())
            self._finish = None
        return self._outcome


def block_array(pool: torch.Tensor, block: int) -> np.ndarray:
    """Block `block` of a CPU pool, as the flat bytes it is (no copy)."""
    return pool[block].reshape(-1).view(torch.uint8).numpy()


class TierCopier:
    """Copies for one runner; `tiers[i]` holds the bytes of KVTiers.tiers[i] (a HostTier or a DiskTier)."""

    def __init__(self, tiers: Sequence) -> None:
        self.tiers = tuple(tiers)

    def start(self, saves: Sequence[TierCopy], loads: Sequence[TierCopy], pool_of: PoolOf) -> TierCopies:
        failed = self.write(saves, [block_array(pool_of(c.peer), c.block) for c in saves])
        started = time.perf_counter()
        bad = tuple(i for i, c in enumerate(loads)
                    if not self.tiers[c.tier].read_into(c.slot, c.digest, block_array(pool_of(c.peer), c.block)))
        return TierCopies(TierOutcome(bad, failed, time.perf_counter() - started))

    def write(self, saves: Sequence[TierCopy], blocks: Sequence[np.ndarray]) -> tuple[int, ...]:
        """Write each save's block bytes (`blocks[i]`) to its tier; the indices of those that failed."""
        failed, stamp, crcs = [], time.time_ns(), {}
        for i, (save, data) in enumerate(zip(saves, blocks)):
            where = (save.peer, save.block)
            if where not in crcs:                # NOTE: one block written through to two tiers is summed once
                crcs[where] = checksum(data)
            try:
                self.tiers[save.tier].write(save.slot, save.digest, data, crcs[where], stamp)
            except OSError as e:
                logger.warning("KV tier %s: writing a block failed: %s", self.tiers[save.tier].name, e)
                failed.append(i)
        return tuple(failed)
