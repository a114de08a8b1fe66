"""An actor's part in the KV tiers (`engine.core.tier_plan`): the copies each step carries, what a finished
step's copies mean, and what an abandoned one gives back."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace

from pdserve.engine.core.admission import computable_prefix, tier_hits
from pdserve.engine.core.kv_tiers import KVTiers
from pdserve.engine.core.scheduler import PrefillScheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.tier_plan import TierPlan
from pdserve.engine.worker.step import StepWork
from pdserve.engine.worker.step_runner import StepOutcome


logger = logging.getLogger(__name__)

FLUSH_POLL_S = 0.01
KEEP_TIMEOUT_S = 60          # a stop waits this long at most for the writes (systemd's stop timeout is 90 s)


class Tiering:
    """Mixed into the Actor (its blocks, steps in flight and schedulers)."""

    tier_plan: TierPlan | None = None

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Save the registered blocks leaving this actor's pool to `tiers`, and load prompts' prefixes from them."""
        self.tier_plan = TierPlan(tiers, self.blocks)
        for scheduler in self.prefill_schedulers():
            scheduler.tiers = self.tier_plan

    def prefill_schedulers(self) -> list[PrefillScheduler]:
        """The schedulers that admit prompts into this actor's pool."""
        return []

    @property
    def tier_work_waiting(self) -> bool:
        """Tier copies wait for a step even with nothing to compute (a prompt's loads, a reservation's saves)."""
        return self.tier_plan is not None and self.tier_plan.has_work

    def keep_prefixes(self) -> bool:
        """At a stop: plan the writes of this pool's cached blocks to the tiers that outlive the process; True
        if there are copies to make (`tier_copies_flushed` waits for them)."""
        return self.tier_plan is not None and self.tier_plan.keep(self.blocks.cached_blocks())

    async def tier_copies_flushed(self) -> None:
        """Until no tier copy waits for a step or rides one in flight (this actor's loop makes them)."""
        while self.alive and (self.tier_work_waiting or self._in_flight):
            self.poke()
            await asyncio.sleep(FLUSH_POLL_S)

    def with_tier_copies(self, work: StepWork, step_id: int) -> StepWork:
        plan = self.tier_plan
        step = plan.take(step_id) if plan is not None else None
        return work if step is None else replace(work, tier_saves=step.saves, tier_loads=step.loads)

    def tier_copies_done(self, step_id: int, outcome: StepOutcome) -> None:
        if self.tier_plan is not None:
            tier = outcome.tier
            self.tier_plan.finished(step_id, tier.bad_loads, tier.failed_saves, tier.load_seconds)

    def give_back_tiers(self) -> None:
        """This actor is discarded: each step in flight gives its tier slots back when it ends."""
        plan = self.tier_plan
        if plan is None:
            return
        for step in self._in_flight:
            step.future.add_done_callback(functools.partial(_abandoned, plan, step.step_id))
        plan.abandon_all()

    # what routing reads
    def tier_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` past this pool's prefix-cache hits that the tiers would load here."""
        if self.tier_plan is None or seq.scores_prompt:
            return 0
        hits = len(computable_prefix(self.blocks, seq))
        return tier_hits(self.tier_plan.tiers, self.blocks, seq, hits) * self.blocks.block_size


async def keep_prefixes(actors) -> None:
    """At a stop, with no request left: every pool's cached blocks written to the disk tier before the actors
    stop, so that a restart answers their prefixes from it (a kill keeps only what left the pools before it)."""
    keeping = [actor for actor in actors if actor.alive and actor.keep_prefixes()]
    if not keeping:
        return
    started = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(actor.tier_copies_flushed() for actor in keeping)), KEEP_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.warning("stop: the pools' cached blocks not all on the disk tier after %d s", KEEP_TIMEOUT_S)
    else:
        logger.info("stop: the pools' cached blocks written to the disk tier in %.2f s", time.perf_counter() - started)


def _abandoned(plan: TierPlan, step_id: int, _future) -> None:
    plan.abandon(step_id)
