"""The coordinator: on the event loop, it owns the request table, admission, routing and the KV hand-off
protocol over N prefill units and M units that decode (decode units, or colocated ones).

Actors only step their unit; what one asks of another goes through here (`pdserve.engine.actors.port.Port`):
a prefill unit reserves decode blocks (None: back-pressure), posts its hand-off (delivered to the
decode unit holding the reservation), or releases a reservation it never handed off; a decode unit
posts a preempted sequence (routed to a prefill unit again) and says when it freed blocks.

A failed unit is down (routing skips it) until it serves again or, retired, for good: a fresh actor that
never starts stands in for it, so its pool reads free and nothing is ever routed there (`faults.py`).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.messages import Abort, KVHandoff, Preempted, Release, Request, Reservation
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.coordinator.faults import UnitFaults
from pdserve.engine.coordinator.routing import DecodeView, PrefillView, decode_order, first_token_order

logger = logging.getLogger(__name__)


class NoUnitUp(RuntimeError):
    """Every unit a new request could go to is failing or restarting."""


@dataclass(slots=True)
class Route:
    """Where a request is: the prefill unit it was last sent to, the decode (or colocated) unit holding it."""

    prefill: int | None = None
    decode: int | None = None
    decoding: tuple[float, int] | None = None   # when the planner first saw it decode, and its tokens then


class Coordinator(UnitFaults):
    def __init__(self, prefill: list[Actor], decode: list[Actor], entry_role: str, needs_prefill_units: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`prefill` actors and those that decode (`decode`: decode or colocated units), by unit index. New
        prompts enter on the `entry_role` units; the engine serves while a unit of each role it needs is not
        retired. `clock` is the time requests' arrival times are on (a simulator hands in its virtual one)."""
        self.prefill, self.decode = list(prefill), list(decode)
        self.entry = self.prefill if entry_role == "prefill" else self.decode
        self.needs_prefill_units, self.clock = needs_prefill_units, clock
        self.table: dict[str, Route] = {}
        self.down: dict[str, str] = {}       # the unit faults (`faults.UnitFaults`): which units are down,
        self.retired: set[str] = set()       # which of them for good,
        self._parked: list[Preempted] = []   # and what waits for a prefill unit
        self.lending: set[str] = set()       # the units stepping on lent cores now (adaptive mode)
        for actor in self.actors:
            actor.port, actor.clock = self, clock

    # admission
    def submit(self, request: Request) -> None:
        """Route a new request to the unit with the earliest predicted first token (raises NoUnitUp)."""
        entry = self.entry
        index = self.first_token_unit(entry, request)
        if index is None:
            raise NoUnitUp("every unit that takes new requests is restarting after a failure; retry shortly")
        route = Route(prefill=index) if entry is self.prefill else Route(decode=index)
        self.table[request.request_id] = route
        entry[index].routed_prefill += 1
        entry[index].send(request)

    def first_token_unit(self, actors: list[Actor], seq: Sequence | Request) -> int | None:
        if len(actors) == 1:
            return 0 if self.up(actors[0]) else None
        if isinstance(seq, Request):
            seq = Sequence(seq)
        order = first_token_order([PrefillView(i, a.prefill_work(), a.uncached_tokens(seq),
                                               self._prefill_rate(a, actors), self.up(a), a.tier_tokens(seq))
                                   for i, a in enumerate(actors)], self._tier_rate(actors))
        return order[0] if order else None

    @staticmethod
    def _tier_rate(actors: list[Actor]) -> float | None:
        """The KV tiers' measured copy-in seconds per token (one store for every unit), else None."""
        plan = next((a.tier_plan for a in actors if a.tier_plan is not None), None)
        return plan.tiers.seconds_per_token() if plan is not None else None

    def _prefill_rate(self, actor: Actor, peers: list[Actor]) -> float | None:
        """Measured seconds per prefill token on `actor`'s kind of unit (adaptive mode's cost models), else None."""
        return kind_median(actor, peers, lambda cost, threads: cost.seconds_per_prefill_token(threads))

    def abort(self, request_id: str) -> None:
        """Abort on the units the table says hold the request; on every unit once it left the table."""
        route = self.table.pop(request_id, None)
        if route is None:
            targets = self.serving
        else:
            targets = ([self.prefill[route.prefill]] if route.prefill is not None else []) + \
                      ([self.decode[route.decode]] if route.decode is not None else [])
        for actor in targets:
            actor.send(Abort(request_id))

    def finished(self, request_id: str) -> None:
        """The request's stream ended (its last token, or an error): it leaves the table."""
        self.table.pop(request_id, None)

    def forget_all(self) -> None:
        self.table.clear()
        self._parked.clear()

    # the hand-off protocol (Port)
    def reserve(self, seq: Sequence) -> Reservation | None:
        """Decode blocks on the live decode unit with room and the least predicted step growth; None holds
        the prompt back until a decode unit frees blocks."""
        route = self.table.get(seq.request_id)
        if route is None:                       # aborted: its Abort is on the way to the prefill unit
            return None
        for index in self._decode_order(seq):
            reservation = self.decode[index].reserve(seq)
            if reservation is not None:
                route.decode = index
                self.decode[index].routed_decode += 1
                return reservation
        return None

    def _decode_order(self, seq: Sequence) -> list[int]:
        if len(self.decode) == 1:
            return [0] if self.up(self.decode[0]) else []
        return decode_order([DecodeView(i, d.sequences_held + 1, self._step_after(d), d.cached_blocks(seq),
                                        self.up(d))
                             for i, d in enumerate(self.decode)])

    def _step_after(self, actor: Actor) -> float | None:
        """Its predicted step time with one more row: every sequence holding blocks there (reserved, landing,
        decoding) will decode in its steps."""
        rows = actor.sequences_held + 1
        return kind_median(actor, self.decode, lambda cost, threads: cost.predict(threads, rows, 0))

    def post(self, message) -> None:
        if isinstance(message, KVHandoff):
            route = self.table.get(message.request.request_id)
            if route is not None:
                route.prefill = None                # prefilled: only its decode unit holds it now
            self.decode[message.decode_unit].send(message)
        elif isinstance(message, Release):
            self.decode[message.decode_unit].release(message.request_id)
        elif isinstance(message, Preempted):
            self._prefill_again(message)
        else:
            raise TypeError(f"the coordinator does not take {type(message).__name__} messages")

    def _prefill_again(self, message: Preempted) -> None:
        route = self.table.get(message.request.request_id)
        if route is None:                       # aborted or ended meanwhile
            return
        seq = Sequence(message.request, list(message.output_token_ids))
        index = self.first_token_unit(self.prefill, seq)
        route.prefill, route.decode, route.decoding = index, None, None
        if index is None:                       # no prefill unit up: it waits for one to come back
            self._parked.append(message)
            return
        self.prefill[index].routed_prefill += 1
        self.prefill[index].send(message)

    def prefill_on(self, index: int, seq: Sequence) -> None:
        """Send `seq`, which a unit that decodes took and will not prefill itself, to prefill unit `index`."""
        route = self.table[seq.request_id]
        route.prefill, route.decode = index, None
        self.prefill[index].routed_prefill += 1
        self.prefill[index].send(Preempted(seq.request, tuple(seq.output_token_ids)) if seq.output_token_ids
                                 else seq.request)

    def blocks_freed(self, actor: Actor) -> None:
        for prefill in self.prefill:
            prefill.poke()

    # core lending (adaptive mode's placement decides; a restart or a retirement ends a lent step)
    def partners(self, actor: Actor) -> list[Actor]:
        """The units of the other role: those `actor` would borrow cores from, or lend them to."""
        return self.decode if actor in self.prefill else self.prefill

    def cores_returned(self, actor: Actor) -> None:
        """`actor`'s step on lent cores ended: the units it borrowed from may step again."""
        if actor.unit_name not in self.lending:
            return
        self.lending.discard(actor.unit_name)
        for other in self.partners(actor):
            other.poke()


def kind_median(actor: Actor, peers: list[Actor],
                read: Callable[[StepCostModel, int | None], float | None]) -> float | None:
    """`read` of the cost models of every unit of `actor`'s kind among `peers` (one device type, one thread
    count), their median: units of one kind differ only by their fits' noise, and a noisy fit alone would send
    a conversation's next turn away from its prefix. None when `actor` keeps no cost model or none of its kind
    has measured it."""
    own = actor.priced()
    if own is None:
        return None
    kind = (actor.device.type, own[1])
    readings = [value for peer in peers if (cost := peer.priced()) is not None
                and (peer.device.type, cost[1]) == kind and (value := read(*cost)) is not None]
    return statistics.median(readings) if readings else None
