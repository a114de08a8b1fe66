"""`--mode colocated`, the baseline: each unit prefills and decodes, chunked prefill mixed with decode in one step."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.actors.colocated import ColocatedActor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.messages import ActorStats
from pdserve.engine.modes.base import Mode, Wiring, costed, overlap
from pdserve.engine.units.spec import UnitSpec
from pdserve.engine.worker.compute import Compute


class Colocated(Mode):
    name = "colocated"
    entry_role = "colocated"
    needs_prefill_units = False
    decode_units_prefill = True

    def unit_roles(self, prefill: Sequence[torch.device], decode: Sequence[torch.device]
                   ) -> list[tuple[str, torch.device]]:
        """One colocated unit per prefill device (the decode devices are not used)."""
        return [("colocated", d) for d in prefill]

    def cores_by_role(self, cores: tuple[int, ...], prefill_threads: int | None,
                      decode_threads: int | None) -> dict[str, tuple[int, ...]]:
        return {"colocated": cores[:prefill_threads or len(cores)]}

    def actor(self, spec: UnitSpec, unit: Compute, drafter, wiring: Wiring) -> ColocatedActor:
        config = wiring.config
        actor = ColocatedActor(unit, config.scheduler, config.cache.kv_watermark, wiring.layout.max_model_len,
                               wiring.emit, overlap(config, spec.device, config.speculative is not None),
                               config.cache.enable_prefix_caching, config.speculative, drafter)
        return costed(actor, StepCostModel(), learns=True)

    def counts(self, prefill: Sequence[ActorStats], decoding: Sequence[ActorStats]) -> tuple[int, int]:
        return sum(a.running for a in decoding), sum(a.waiting for a in decoding)
