"""What happens when an actor fails, so that no request ever hangs.

An exception escaping an actor (a step's or its bookkeeping's) or a step running past
`--step-timeout` fails its unit. What follows depends on `--on-worker-failure`:

- `restart` (the default). Where the units not retired, the failed one aside, still serve every phase
  the mode needs (a prefill and a decode unit in disaggregated mode; a decode unit in adaptive mode,
  which prefills too; a colocated unit), the failure stays local: the unit's own requests end with
  an error event, routing skips it, and it is restarted alone (a dead worker process is spawned
  again) while the others keep serving. A unit that cannot be restarted (its restart raised, the
  restart limit was reached, or its thread is stuck in a step and cannot be reclaimed) is retired:
  routing skips it for good, /health reports it down and why, `pdserve_unit_retired` shows it, and
  the engine serves on with the others; a stuck thread is abandoned and its cores stay taken until
  the server restarts. Otherwise (the failed unit is the last of a role the mode needs) every
  unfinished request ends with an error event and fresh actors (empty schedulers and block managers)
  are wired over the units not retired; when that cannot be done either, the engine is dead.
- `exit`: any unit's failure, even with other units serving, ends every unfinished request with an
  error event and marks the engine dead, as vLLM and SGLang exit on a worker's failure.

A dead engine answers /health and new requests with 503, the systemd watchdog stops being pinged
and the server exits non-zero, so systemd restarts it (`Restart=on-failure`). At most MAX_RESTARTS
restarts (of any units) within RESTART_WINDOW_S: one more counts as a unit that cannot be restarted.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.actors.base import Actor

logger = logging.getLogger(__name__)

POLICIES = ("restart", "exit")
MAX_RESTARTS = 3                 # within RESTART_WINDOW_S; one more is refused (unit retired or engine dead)
RESTART_WINDOW_S = 60.0


class Supervised(Protocol):
    """What the supervisor needs of the engine it watches."""

    actors: Sequence[Actor]

    def fail_unfinished(self, error: str) -> None: ...

    async def abandon_actors(self) -> None: ...

    async def restart_actors(self, recover_stuck: bool) -> None: ...

    def can_recover_stuck(self, actor: Actor | None = None) -> bool: ...

    def can_fail_alone(self, actor: Actor) -> bool: ...

    def can_serve(self) -> bool: ...

    def fail_unit(self, actor: Actor, error: str) -> None: ...

    async def restart_unit(self, actor: Actor, recover_stuck: bool) -> None: ...

    async def retire_unit(self, actor: Actor, why: str, stuck: bool) -> None: ...


class Supervisor:
    def __init__(self, engine: Supervised, policy: str, step_timeout: float) -> None:
        if policy not in POLICIES:
            raise ValueError(f"on_worker_failure must be one of {', '.join(POLICIES)}, got {policy!r}")
        if step_timeout < 0:
            raise ValueError(f"step_timeout must be >= 0 (0 disables it), got {step_timeout}")
        self.engine, self.policy, self.step_timeout = engine, policy, step_timeout
        self.restarts = 0
        self.dead: str | None = None          # why the engine is dead; None while it is not
        self.recovering = False
        self._restart_times: deque[float] = deque()
        self._watch: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None
        self.units_down: dict[str, asyncio.Task] = {}     # unit name -> its restart under way
        self.died = asyncio.Event()

    def start(self) -> None:
        self.died = asyncio.Event()
        if self.step_timeout:
            self._watch = asyncio.get_running_loop().create_task(self._watch_steps(), name="pdserve-supervisor")

    async def stop(self) -> None:
        """Stop watching; a restart under way is finished first (cancelled half-way, it would leave
        abandoned actors to the next start and `recovering` set for good)."""
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._recovery is not None:
            await asyncio.shield(self._recovery)
        for task in list(self.units_down.values()):
            await asyncio.shield(task)
        self._watch = self._recovery = None

    def actor_failed(self, actor: Actor, error: str, stuck: bool = False) -> None:
        """Called by a failing actor (on the loop); the first failure of a round is the one acted on."""
        if self.recovering or self.dead is not None or actor.unit_name in self.units_down:
            return
        if self.policy == "restart" and self.engine.can_fail_alone(actor):
            self.units_down[actor.unit_name] = asyncio.get_running_loop().create_task(
                self._recover_unit(actor, error, stuck), name=f"pdserve-recovery-{actor.unit_name}")
            return
        self.recovering = True
        self._recovery = asyncio.get_running_loop().create_task(self._recover(actor.unit_name, error, stuck),
                                                                name="pdserve-recovery")

    async def _watch_steps(self) -> None:
        period = min(1.0, self.step_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for actor in self.engine.actors:
                if actor.unit_name in self.units_down:
                    continue
                started = actor.step_started_at
                if started is not None and now - started > self.step_timeout:
                    logger.error("%s actor: a step has run for %.1f s, past --step-timeout %g s",
                                 actor.name, now - started, self.step_timeout)
                    self.actor_failed(actor, f"a step ran past --step-timeout ({self.step_timeout:g} s)",
                                      stuck=True)
                    break

    async def _recover(self, name: str, error: str, stuck: bool) -> None:
        engine = self.engine
        reason = f"the {name} actor failed: {error}"
        engine.fail_unfinished(reason)
        await engine.abandon_actors()
        why_not = self._why_not_restart(stuck)
        if why_not is None:
            try:
                await engine.restart_actors(recover_stuck=stuck)
            except Exception as e:                # NOTE: a unit that cannot come back is as bad as a dead one
                logger.exception("restarting the actors failed")
                why_not = f"restarting failed: {type(e).__name__}: {e}"
        if why_not is not None:
            self._die(f"{reason} ({why_not})")
        else:
            self.restarts += 1
            logger.warning("actors restarted after: %s (%d restarts in the last %g s)",
                           reason, len(self._restart_times), RESTART_WINDOW_S)
        self.recovering = False

    async def _recover_unit(self, actor: Actor, error: str, stuck: bool) -> None:
        """One unit failed while the others serve every phase: end its requests, restart it alone, or
        retire it when it cannot be restarted."""
        reason = f"the {actor.unit_name} unit failed: {error}"
        self.engine.fail_unit(actor, reason)
        await actor.abandon()
        try:
            why_not = await self._restart_unit(actor, stuck)
            if why_not is None:
                self.restarts += 1
                logger.warning("unit %s restarted after: %s", actor.unit_name, reason)
            else:
                await self._retire(actor, f"{reason} (not restarted: {why_not})", stuck)
        finally:
            del self.units_down[actor.unit_name]

    async def _restart_unit(self, actor: Actor, stuck: bool) -> str | None:
        """Restart `actor`'s unit; returns why it was not, or None."""
        why_not = self._why_not_restart(stuck, actor)
        if why_not is None:
            try:
                await self.engine.restart_unit(actor, recover_stuck=stuck)
            except Exception as e:
                logger.exception("restarting unit %s failed", actor.unit_name)
                why_not = f"restarting failed: {type(e).__name__}: {e}"
        return why_not

    async def _retire(self, actor: Actor, why: str, stuck: bool) -> None:
        try:
            await self.engine.retire_unit(actor, why, stuck)
        except Exception as e:                    # NOTE: a unit that cannot even be retired is as bad as a dead one
            logger.exception("retiring unit %s failed", actor.unit_name)
            self._die(f"{why}; retiring it failed: {type(e).__name__}: {e}")
            return
        if not self.engine.can_serve():           # another unit of its role was retired meanwhile
            self._die(f"{why}; no unit is left to serve every phase")

    def _die(self, why: str) -> None:
        self.dead = why
        logger.critical("engine dead: %s", why)
        self.engine.fail_unfinished(why)
        self.died.set()

    def _why_not_restart(self, stuck: bool, actor: Actor | None = None) -> str | None:
        if self.policy == "exit":
            return "--on-worker-failure exit"
        if stuck and not self.engine.can_recover_stuck(actor):
            return "a thread stuck in a step cannot be reclaimed; use --workers process to restart it"
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        if len(self._restart_times) >= MAX_RESTARTS:
            return f"{MAX_RESTARTS} restarts within {RESTART_WINDOW_S:g} s already"
        self._restart_times.append(now)
        return None
