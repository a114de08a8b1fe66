"""`--mode adaptive`, the default: an SLO planner places each prompt on a decode unit (prefilled in its own steps)
or a prefill unit, sizes what each step carries, and lends an idle unit's cores to the other (docs/adaptive.md)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.coordinator.slo import MeasuredUnits, Slos
from pdserve.engine.core.messages import ActorStats
from pdserve.engine.modes.adaptive.actors import AdaptiveDecodeActor, LendingPrefillActor
from pdserve.engine.modes.adaptive.placement import Placement
from pdserve.engine.modes.adaptive.planner import Planner
from pdserve.engine.modes.base import Mode, Wiring, costed, overlap
from pdserve.engine.units.spec import UnitSpec
from pdserve.engine.worker.compute import Compute


class Adaptive(Mode):
    name = "adaptive"
    entry_role = "decode"
    needs_prefill_units = False          # a decode unit prefills too
    decode_units_prefill = True

    def __init__(self) -> None:
        self.costs: dict[tuple[str, int], StepCostModel] = {}   # per unit, kept over its actors' restarts
        self.placement: Placement | None = None
        self.max_prefill_tokens = 0

    def warmup_role(self, role: str) -> str:
        return "colocated" if role == "decode" else role

    def lends_cores(self, roles: Sequence[tuple[str, torch.device]]) -> bool:
        """One CPU prefill unit and one CPU decode unit lend each other their cores."""
        return len(roles) == 2 and {r for r, _ in roles} == {"prefill", "decode"} and \
            all(d.type == "cpu" for _, d in roles)

    def wire(self, coordinator, wiring: Wiring) -> None:
        """The placement reads `coordinator`'s routes (wired again after a restart, it keeps the planner: the SLOs
        do not change)."""
        planner = self.placement and self.placement.planner
        self.placement = Placement(coordinator, wiring.layout.lending)
        self.placement.planner = planner
        self.max_prefill_tokens = wiring.config.scheduler.max_prefill_tokens
        for actor in coordinator.actors:
            actor.placement = self.placement

    def actor(self, spec: UnitSpec, unit: Compute, drafter, wiring: Wiring) -> Actor:
        config, layout = wiring.config, wiring.layout
        caching, share = config.cache.enable_prefix_caching, layout.lending
        cost = self.costs.setdefault((spec.role, spec.index), StepCostModel())
        if spec.role == "prefill":
            return LendingPrefillActor(unit, config.scheduler, layout.max_model_len, wiring.emit,
                                       overlap(config, spec.device, False), caching, cost=cost, share=share,
                                       placement=self.placement)
        actor = AdaptiveDecodeActor(unit, config.scheduler, config.cache.kv_watermark, layout.max_model_len,
                                    wiring.emit, overlap(config, spec.device, config.speculative is not None),
                                    caching, config.speculative, drafter, cost=cost, share=share,
                                    placement=self.placement)
        return costed(actor, cost, learns=False)

    def serve(self, coordinator, slos: Slos, measured: MeasuredUnits | None) -> None:
        """Each unit's cost model starts from the start-up profile of its role's first unit; the planner decides."""
        if measured is not None:
            for actors, profile in ((coordinator.decode, measured.decode), (coordinator.prefill, measured.prefill)):
                for actor in actors:
                    actor.priced()[0].learn_from(profile)
        self.placement.planner = Planner(slos, self.max_prefill_tokens)

    def counts(self, prefill: Sequence[ActorStats], decoding: Sequence[ActorStats]) -> tuple[int, int]:
        """Running: decoding and landing on the decode units; waiting: queued for a prefill anywhere."""
        return sum(a.running for a in decoding), sum(a.waiting for a in (*decoding, *prefill))
