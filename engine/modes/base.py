"""What a serving mode decides, in one object per mode: which units exist and what each warms up as, where a
new prompt enters, which actor each unit runs, what the engine needs to keep serving, and how its counts add
up. The engine picks the mode once at start-up; nothing else branches on a mode's name."""
from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.actors.base import Actor, Emit
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.config import EngineConfig
from pdserve.engine.coordinator.slo import MeasuredUnits, Slos
from pdserve.engine.core.messages import ActorStats
from pdserve.engine.units.spec import Layout, UnitSpec
from pdserve.engine.worker.compute import Compute

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Wiring:
    """What every actor of one engine is built with."""

    config: EngineConfig
    layout: Layout
    emit: Emit


class Mode(abc.ABC):
    """One serving mode. Its roles: `prefill` and `decode` units, or `colocated` units alone."""

    name: str
    entry_role: str                  # where a new prompt is routed: the earliest first token among these units
    needs_prefill_units: bool        # whether the engine serves only while a prefill unit does
    decode_units_prefill: bool       # whether the units that decode also prefill (in their own steps)

    def __str__(self) -> str:
        return self.name

    # the layout (engine.units.layout asks)
    def unit_roles(self, prefill: Sequence[torch.device], decode: Sequence[torch.device]
                   ) -> list[tuple[str, torch.device]]:
        """One (role, device) per unit, prefill units first."""
        return [("prefill", d) for d in prefill] + [("decode", d) for d in decode]

    def cores_by_role(self, cores: tuple[int, ...], prefill_threads: int | None,
                      decode_threads: int | None) -> dict[str, tuple[int, ...]]:
        """The CPU cores each role's units share: half each by default, or the threads asked for."""
        half = max(len(cores) // 2, 1)
        prefill_n = prefill_threads or half
        decode_n = decode_threads or max(len(cores) - prefill_n, 1)
        if prefill_n + decode_n > len(cores):
            logger.warning("prefill (%d) + decode (%d) threads exceed the %d cores available; they will share",
                           prefill_n, decode_n, len(cores))
            return {"prefill": cores[:prefill_n], "decode": cores[-decode_n:]}
        return {"prefill": cores[:prefill_n], "decode": cores[prefill_n:prefill_n + decode_n]}

    def warmup_role(self, role: str) -> str:
        """The steps a unit of `role` is warmed up and profiled for."""
        return role

    def lends_cores(self, roles: Sequence[tuple[str, torch.device]]) -> bool:
        """Whether the units step on each other's cores when one idles (core lending)."""
        return False

    # the actors
    @abc.abstractmethod
    def actor(self, spec: UnitSpec, unit: Compute, drafter, wiring: Wiring) -> Actor:
        """A fresh actor (nothing queued, not started) over `unit`, as `spec` says."""

    def wire(self, coordinator, wiring: Wiring) -> None:
        """`coordinator` is built over this mode's actors (again after a restart)."""

    def serve(self, coordinator, slos: Slos, measured: MeasuredUnits | None) -> None:
        """The SLOs are known (set, or derived from the start-up profile `measured`): start deciding with them."""

    @abc.abstractmethod
    def counts(self, prefill: Sequence[ActorStats], decoding: Sequence[ActorStats]) -> tuple[int, int]:
        """(requests running, requests waiting) from the actors' stats."""


def overlap(config: EngineConfig, device: torch.device, verifies: bool) -> bool:
    """Async scheduling: forced by the config, else on for CUDA and off on CPU (bench/RESULTS.md, "Host work per
    step"). Never for an actor that verifies drafts: its next step's positions depend on the drafts kept."""
    if verifies:
        if config.async_scheduling:
            logger.warning("--async-scheduling is off for the decode side: speculative decoding is on")
        return False
    return config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"


def costed(actor: Actor, cost: StepCostModel, learns: bool) -> Actor:
    """`actor`, its speculator (if any) pricing verification with `cost`; `learns`: the speculator feeds `cost`
    the actor's steps (where the actor does not feed its own)."""
    if actor.speculator is not None:
        actor.speculator.gate.use(cost, learns)
    return actor
