"""`--mode disaggregated`: prefill units prefill every prompt and hand its KV to a decode unit."""
from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.decode import DecodeActor
from pdserve.engine.actors.prefill import PrefillActor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.messages import ActorStats
from pdserve.engine.modes.base import Mode, Wiring, costed, overlap
from pdserve.engine.units.spec import UnitSpec
from pdserve.engine.worker.compute import Compute


class Disaggregated(Mode):
    name = "disaggregated"
    entry_role = "prefill"
    needs_prefill_units = True
    decode_units_prefill = False

    def actor(self, spec: UnitSpec, unit: Compute, drafter, wiring: Wiring) -> Actor:
        config, caching = wiring.config, wiring.config.cache.enable_prefix_caching
        max_model_len = wiring.layout.max_model_len
        if spec.role == "prefill":
            return PrefillActor(unit, config.scheduler, max_model_len, wiring.emit,
                                overlap(config, spec.device, False), caching)
        actor = DecodeActor(unit, config.scheduler, config.cache.kv_watermark, max_model_len, wiring.emit,
                            overlap(config, spec.device, config.speculative is not None), caching,
                            config.speculative, drafter)
        return costed(actor, StepCostModel(), learns=True)

    def counts(self, prefill: Sequence[ActorStats], decoding: Sequence[ActorStats]) -> tuple[int, int]:
        """Running: every sequence a decode unit holds (landing too); waiting: queued for a prefill unit."""
        return sum(a.running + a.waiting for a in decoding), sum(a.waiting for a in prefill)
