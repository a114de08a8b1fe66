"""The KV tiers below the pools, as the event loop sees them: one TierIndex per tier (host memory first, then
disk), shared by every unit of the engine, and the block copies a step makes between a pool and a tier.

Write-through: a registered block leaving a pool is written to every tier that lacks it (the disk tier keeps
it across restarts, the host tier serves it fast); a prompt's prefix continues in the tiers for as long as
each next block hash is held by one of them, read from the fastest that holds it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pdserve.engine.core.tier_index import TierIndex

OWN_POOL = -1          # TierCopy.peer of a block of the stepping unit's own pool


class TierCopy(NamedTuple):
    """One block between a pool and a tier slot: saved (pool -> tier) or loaded (tier -> pool)."""

    block: int           # in the stepping unit's pool, or in its peer pool `peer` (a decode unit's)
    tier: int            # index into KVTiers.tiers
    slot: int
    digest: bytes        # the prefix-cache hash of the block: the record carries it, a load checks it
    peer: int = OWN_POOL


class TierStats(NamedTuple):
    """One tier's counters, for /metrics."""

    name: str
    capacity_blocks: int
    blocks: int          # held now
    hit_tokens: int      # prompt tokens loaded from it instead of computed
    bytes_in: int
    bytes_out: int
    evictions: int
    bad_blocks: int      # records that failed their check (dropped, recomputed, never used)


class KVTiers:
    """The tiers of one engine, fastest first; `block_bytes` of KV per block, `block_size` tokens."""

    def __init__(self, tiers: Sequence[TierIndex], block_size: int, block_bytes: int) -> None:
        self.tiers = tuple(tiers)
        self.block_size, self.block_bytes = block_size, block_bytes
        self.load_seconds = 0.0          # summed over finished loads: the copy-in price routing weighs
        self.loaded_blocks = 0

    def lookup(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """(tier, slot) of each of `hashes` in order, up to the first that no tier holds."""
        found = []
        for digest in hashes:
            hit = next(((i, slot) for i, tier in enumerate(self.tiers) if (slot := tier.find(digest)) is not None),
                       None)
            if hit is None:
                break
            found.append(hit)
        return found

    def plan_saves(self, evicted: Sequence[tuple[int, bytes]], peer: int = OWN_POOL,
                   only: Sequence[int] | None = None) -> list[TierCopy]:
        """Copies that write each evicted (block, hash) to every tier lacking it (of the tiers `only`, if given);
        a tier with no slot to spare (every one pinned or being written) skips it."""
        saves = []
        for block, digest in evicted:
            for i, tier in enumerate(self.tiers):
                if only is not None and i not in only:
                    continue
                if tier.holds(digest):
                    tier.touch(digest)
                    continue
                slot = tier.reserve(digest)
                if slot is not None:
                    saves.append(TierCopy(block, i, slot, digest, peer))
        return saves

    @property
    def lasting(self) -> tuple[int, ...]:
        """The tiers that outlive the process (the disk tier)."""
        return tuple(i for i, tier in enumerate(self.tiers) if tier.name == "disk")

    def seconds_per_token(self) -> float | None:
        """The measured copy-in time of one token's KV from the tiers; None before any load."""
        if not self.loaded_blocks:
            return None
        return self.load_seconds / (self.loaded_blocks * self.block_size)

    def stats(self) -> tuple[TierStats, ...]:
        b = self.block_bytes
        return tuple(TierStats(t.name, t.num_slots, len(t), t.hits * self.block_size, t.blocks_in * b,
                               t.blocks_out * b, t.evictions, t.bad_blocks) for t in self.tiers)

    def check_consistency(self) -> None:
        for tier in self.tiers:
            tier.check_consistency()
