"""The engine's part in a failure (`pdserve.engine.supervisor` decides when): end the failed unit's requests,
restart its actor, retire it, or rebuild every actor, so that no request ever hangs."""
from __future__ import annotations

import logging

from pdserve.engine.actors.base import Actor
from pdserve.engine.core.messages import FinishReason

logger = logging.getLogger(__name__)


class Recovery:
    """Mixed into the Engine (its coordinator, streams, units, mode and supervisor)."""

    def fail_unfinished(self, error: str) -> None:
        """End every unfinished request with an error event; nothing new is accepted until restarted."""
        self._running = False
        self.coordinator.forget_all()
        failed = self.streams.end_all(self.streams.open, FinishReason.ERROR, error)
        if failed:
            logger.error("%d unfinished requests ended with an error: %s", failed, error)

    async def abandon_actors(self) -> None:
        for actor in self.actors:
            await actor.abandon()

    def can_recover_stuck(self, actor: Actor | None = None) -> bool:
        """A unit stuck in a step (`actor`'s; None: any unit) can be killed and spawned again only when it is
        a process or a Ray actor."""
        units = self.units.all() if actor is None else (actor.unit,)
        return all(unit.kind in ("process", "ray") for unit in units)

    async def restart_actors(self, recover_stuck: bool) -> None:
        """Fresh actors over the same units (a worker process that died or hangs is spawned again); the
        retired units stay retired."""
        old = self.coordinator
        for actor in old.serving:
            await actor.unit.recover(force=recover_stuck)
        self.coordinator = self._wire()
        for actor in self.coordinator.actors:
            if actor.unit_name in old.retired:
                self.coordinator.retire(actor, actor, old.down[actor.unit_name])
        for actor in self.coordinator.serving:
            self._start_actor(actor)
        self._running = True

    def can_fail_alone(self, actor: Actor) -> bool:
        """The units not retired, `actor`'s aside, serve every phase the mode needs: its failure stays local."""
        return self.coordinator.serves_without(actor)

    def can_serve(self) -> bool:
        """The units not retired serve every phase the mode needs."""
        return self.coordinator.serves_without()

    def fail_unit(self, actor: Actor, error: str) -> None:
        """End the requests `actor`'s unit holds with an error event (their other units free them)."""
        failed = self.streams.end_all(self.coordinator.fail_unit(actor, error), FinishReason.ERROR, error)
        if failed:
            logger.error("%d requests on unit %s ended with an error: %s", failed, actor.unit_name, error)

    async def restart_unit(self, actor: Actor, recover_stuck: bool) -> None:
        """A fresh actor over `actor`'s unit (a worker process that died or hangs is spawned again)."""
        await self.coordinator.quiesce(actor)
        await actor.unit.recover(force=recover_stuck)
        fresh = self._fresh_actor(actor)
        fresh.on_failure = self.supervisor.actor_failed
        self.coordinator.unit_up(actor, fresh)
        self._start_actor(fresh)

    async def retire_unit(self, actor: Actor, why: str, stuck: bool) -> None:
        """`actor`'s unit serves no more, until the server restarts (its requests have ended): a fresh actor
        that never starts stands in for it, so its pool reads free and routing skips it for good.
        `stuck`: its thread is inside a step, abandoned (nothing is waited for on it)."""
        await self.coordinator.quiesce(actor, stuck)
        stand_in = self._fresh_actor(actor)
        self.coordinator.retire(actor, stand_in, why)
        if stuck and actor.unit.kind == "thread":
            logger.error("unit %s retired: its compute thread is stuck in a step and is abandoned; its %s stay "
                         "taken until the server restarts", actor.unit_name, _compute_of(actor.unit))
        logger.error("unit %s retired, the other units serve on: %s", actor.unit_name, why)

    def units_up(self) -> list[dict]:
        """Every unit: its name, role, whether it serves now, its state and, when down, why (for /health)."""
        return [{"unit": name, "role": role, "up": state == "up", "state": state} | ({"error": why} if why else {})
                for name, role, state, why in self.coordinator.units()]


def _compute_of(unit) -> str:
    """What a thread unit steps on, for a log line: its CPU cores, else its device."""
    cores = unit.cpu_cores
    return f"CPU cores {','.join(map(str, cores))}" if cores else f"device {unit.device}"
