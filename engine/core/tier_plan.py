"""One actor's side of the KV tiers: which blocks its next step saves and loads, and what a finished step's
copies mean (plain Python: the step's runner makes the copies, `engine.worker.tiers`).

A registered block leaving the pool (`BlockManager.evicted`: its id handed out again) is saved by the next
step, before that step's forward can overwrite it. A prompt admitted with blocks found in a tier past its
pool hits has them loaded by the next step and waits (`Sequence.loading`) until that step has ended: then
the blocks that passed their check count as computed and cached, and a block that failed it, and every
one after, is computed instead.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.kv_tiers import KVTiers, TierCopy
from pdserve.engine.core.sequence import Sequence


class Loading(NamedTuple):
    """A sequence's blocks `first` .. `first + len(copies) - 1` (of its table), loaded by one step."""

    seq: Sequence
    first: int
    copies: tuple[TierCopy, ...]


@dataclass(frozen=True, slots=True)
class TierStep:
    """The tier copies of one step: saves first, then loads, both before its forward."""

    saves: tuple[TierCopy, ...]
    loads: tuple[TierCopy, ...]
    loading: tuple[Loading, ...]


class TierPlan:
    def __init__(self, tiers: KVTiers, blocks: BlockManager) -> None:
        self.tiers, self.blocks = tiers, blocks
        blocks.evicted = []                     # NOTE: from now on the block manager reports what leaves
        self._saves: list[TierCopy] = []     # saves of blocks that stay in the pool: a peer's, or kept at a stop
        self._loading: list[Loading] = []
        self._in_flight: dict[int, TierStep] = {}

    def load_prefix(self, seq: Sequence, cached: int, limit: int) -> int:
        """Plan loads of `seq`'s blocks `cached` .. `limit - 1` that the tiers hold, from the first on (its table
        covers them, its hashes are known); returns how many. `seq` waits for them (`loading`)."""
        hashes = seq.block_hashes[cached:limit]
        found = self.tiers.lookup(hashes)
        if not found:
            return 0
        copies = tuple(TierCopy(seq.block_table[cached + i], tier, slot, hashes[i])
                       for i, (tier, slot) in enumerate(found))
        for copy in copies:
            self.tiers.tiers[copy.tier].pin(copy.slot)
        self._loading.append(Loading(seq, cached, copies))
        seq.loading = True
        return len(copies)

    def peer_evicted(self, peer: int, evicted: Seq[tuple[int, bytes]]) -> None:
        """Blocks of decode unit `peer`'s pool that a reservation for this actor took: this actor's next step
        saves them, before its copies into them."""
        self._saves += self.tiers.plan_saves(evicted, peer)

    def keep(self, cached: Seq[tuple[int, bytes]]) -> bool:
        """Write the pool's `cached` blocks to the tiers that outlive the process (at a stop: the next start
        answers their prefixes from there), the most recently registered up to each tier's size; True if a
        copy waits for a step."""
        lasting = self.tiers.lasting
        room = max((self.tiers.tiers[i].num_slots for i in lasting), default=0)
        saves = self.tiers.plan_saves(cached[len(cached) - room:] if room else (), only=lasting)
        self._saves += saves
        return bool(saves)

    @property
    def has_work(self) -> bool:
        """Copies wait for a step, even one with nothing to compute.

        NOTE: own evictions too: a block evicted by a schedule that ended up running nothing (its sequence
        preempted at once) is free again, and a reservation may hand it to a prefill unit whose copy would
        overwrite it before a later step of this actor saved it."""
        return bool(self._loading or self._saves or self.blocks.evicted)

    def take(self, step_id: int) -> TierStep | None:
        """The copies step `step_id` makes (None: none); its loading sequences are fenced by it."""
        saves = self.tiers.plan_saves(self.blocks.take_evicted()) + self._saves
        loading, self._loading, self._saves = tuple(self._loading), [], []
        if not saves and not loading:
            return None
        step = TierStep(tuple(saves), tuple(c for entry in loading for c in entry.copies), loading)
        for entry in loading:
            entry.seq.last_step = step_id       # NOTE: its blocks are written by this step
        self._in_flight[step_id] = step
        return step

    def finished(self, step_id: int, bad_loads: Seq[int], failed_saves: Seq[int], load_seconds: float) -> None:
        """Step `step_id` ended: its saved blocks are readable, its loaded ones count up to the first that
        failed its check (that one is dropped from its tier), and its loading sequences may run."""
        step = self._in_flight.pop(step_id, None)
        if step is None:
            return
        failed = set(failed_saves)
        for i, save in enumerate(step.saves):
            tier = self.tiers.tiers[save.tier]
            tier.abandon(save.slot) if i in failed else tier.commit(save.slot)
        bad, offset = set(bad_loads), 0
        for entry in step.loading:
            count = len(entry.copies)
            good = next((k for k in range(count) if offset + k in bad), count)
            for k, copy in enumerate(entry.copies):
                tier = self.tiers.tiers[copy.tier]
                if offset + k in bad:
                    tier.drop(copy.slot)
                tier.unpin(copy.slot, read=k < good)
            offset += count
            self._loaded(entry, good)
        if step.loads:
            self.tiers.load_seconds += load_seconds
            self.tiers.loaded_blocks += len(step.loads)

    def _loaded(self, entry: Loading, good: int) -> None:
        seq = entry.seq
        seq.loading = False
        if seq.done:
            return
        cached = entry.first + good
        seq.num_computed_tokens = seq.num_cached_tokens = cached * self.blocks.block_size
        self.blocks.register(seq.request_id, seq.block_hashes[:cached], entry.first)
        seq.num_registered_blocks = cached

    def abandon(self, step_id: int) -> None:
        """Step `step_id` will never be recorded (its actor was discarded): its slots go back unread."""
        step = self._in_flight.pop(step_id, None)
        if step is not None:
            self._release(step.saves, step.loads)

    def abandon_all(self) -> None:
        """Release what no step has taken yet (the actor is being discarded)."""
        self._release(self._saves, [c for entry in self._loading for c in entry.copies])
        self._saves, self._loading = [], []

    def _release(self, saves: Seq[TierCopy], loads: Seq[TierCopy]) -> None:
        for save in saves:
            self.tiers.tiers[save.tier].abandon(save.slot)
        for load in loads:
            self.tiers.tiers[load.tier].unpin(load.slot, read=False)
