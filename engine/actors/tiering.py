"""An actor's part in the KV tiers (`engine.core.tier_plan`): the copies each step carries, what a finished
step's copies mean, and what an abandoned one gives back."""
from __future__ import annotations

import functools
from dataclasses import replace

from pdserve.engine.core.admission import computable_prefix, tier_hits
from pdserve.engine.core.kv_tiers import KVTiers
from pdserve.engine.core.scheduler import PrefillScheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.tier_plan import TierPlan
from pdserve.engine.worker.step import StepWork
from pdserve.engine.worker.step_runner import StepOutcome


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


def _abandoned(plan: TierPlan, step_id: int, _future) -> None:
    plan.abandon(step_id)
