"""The coordinator's part in a unit's failure (`pdserve.engine.supervisor` decides when): a failed unit is
down, its requests aborted on their other units, until it serves again or, retired, for good."""
from __future__ import annotations

import logging
import math

from pdserve.engine.actors.base import Actor
from pdserve.engine.core.messages import Preempted

logger = logging.getLogger(__name__)

NEVER = math.inf                # the fence of blocks held for good (a stuck step may still write them)


class UnitFaults:
    """Mixed into the Coordinator: what a unit's failure, restart and retirement change in its state (it
    calls the coordinator's `abort`, `_prefill_again` and `cores_returned`)."""

    needs_prefill_units: bool        # the mode serves only while a prefill unit does
    prefill: list[Actor]
    decode: list[Actor]
    table: dict
    down: dict[str, str]             # unit name -> why it is failing, restarting or retired: routing skips it
    retired: set[str]                # unit names that serve no more (until the server restarts)
    _parked: list[Preempted]         # preempted while no prefill unit was up: routed when one is

    @property
    def actors(self) -> list[Actor]:
        return [*self.prefill, *self.decode]

    @property
    def serving(self) -> list[Actor]:
        """Every actor of a unit not retired (its loop runs, or will once restarted)."""
        return [a for a in self.actors if a.unit_name not in self.retired]

    def up(self, actor: Actor) -> bool:
        return actor.unit_name not in self.down

    def replace(self, old: Actor, new: Actor) -> None:
        """A restarted unit's fresh actor (or a retired one's stand-in) takes `old`'s place (same unit, index)."""
        role = self.prefill if old in self.prefill else self.decode
        index = role.index(old)
        self.cores_returned(old)            # NOTE: a unit that failed inside a lent step lends nothing now
        new.index, new.unit_name, new.port = old.index, old.unit_name, self
        role[index] = new

    def fail_unit(self, actor: Actor, error: str) -> list[str]:
        """Mark `actor`'s unit down (routing skips it) and abort, on their other units, the requests it
        holds; returns their ids (the engine ends their streams with an error)."""
        self.down[actor.unit_name] = error
        prefill = actor in self.prefill
        held = [request_id for request_id, route in self.table.items()
                if (route.prefill if prefill else route.decode) == actor.index]
        for request_id in held:
            self.abort(request_id)
        return held

    async def quiesce(self, actor: Actor, stuck: bool = False) -> None:
        """Before `actor`'s unit gets a fresh actor (and free lists): no copy still reads or writes its pool,
        and a failed prefill unit's reservations it never handed off are given back. `stuck`: its thread
        is inside a step that may never end, so nothing is waited for on it (see `_release_stuck`)."""
        if actor in self.decode:
            for prefill in self.prefill:
                if prefill is not actor and self.up(prefill):
                    await prefill.steps_done()
                    for transfer in prefill.copies_to(actor.index):
                        await prefill.unit.wait(transfer)
            return
        if stuck:
            self._release_stuck(actor)
            return
        for out in list(actor.outgoing.values()):
            for transfer in out.transfers:
                await actor.unit.wait(transfer)
            if not out.handed_off:
                self.decode[out.decode_unit].release(out.seq.request_id)

    def _release_stuck(self, actor: Actor) -> None:
        """A stuck prefill unit's reservations go back, but those its unfinished steps copy into (or whose
        copies have not landed): a step that ever returns still writes them, so they stay held for good."""
        kept = []
        for out in actor.outgoing.values():
            if out.handed_off:
                continue
            decode = self.decode[out.decode_unit]
            if out.landed() and out.seq.last_step <= actor.completed_step:
                decode.release(out.seq.request_id)
            else:                               # NOTE: no step reaches fence NEVER; the request id is free again
                decode.blocks.free_after(out.seq.request_id, NEVER)
                kept.append(f"{decode.unit_name}: {len(out.decode_blocks)}")
        if kept:
            logger.error("unit %s is stuck in a step that copies into these decode blocks; they stay held "
                         "until the server restarts (unit: blocks): %s", actor.unit_name, ", ".join(kept))

    def unit_up(self, old: Actor, new: Actor) -> None:
        """`new` serves `old`'s restarted unit: routing takes it again (and the prompts parked for it)."""
        self.replace(old, new)
        self.down.pop(new.unit_name, None)
        parked, self._parked = self._parked, []
        for message in parked:
            self._prefill_again(message)

    def retire(self, old: Actor, stand_in: Actor, why: str) -> None:
        """`old`'s unit serves no more: `stand_in` (never started) takes its place, down for good."""
        self.replace(old, stand_in)
        self.down[old.unit_name] = why
        self.retired.add(old.unit_name)

    def serves_without(self, actor: Actor | None = None) -> bool:
        """Whether the units not retired, `actor`'s aside, still serve every phase of the mode: a prefill and
        a decode unit (disaggregated), a decode unit (adaptive: it prefills too), a colocated unit."""
        def left(actors: list[Actor]) -> bool:
            return any(a is not actor and a.unit_name not in self.retired for a in actors)
        return left(self.decode) and (not self.needs_prefill_units or left(self.prefill))

    def units(self) -> list[tuple[str, str, str, str | None]]:
        """(unit name, role, state, why it is down or None) of every unit; the state is `up`, `restarting`
        (failed, its restart under way), `retired` (it serves no more) or `stopped` (the engine is)."""
        def state(a: Actor) -> str:
            if a.unit_name in self.retired:
                return "retired"
            return "restarting" if not self.up(a) else "up" if a.alive else "stopped"
        return [(a.unit_name, a.name, state(a), self.down.get(a.unit_name)) for a in self.actors]
