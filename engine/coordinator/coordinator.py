"""The coordinator: on the event loop, it owns the request table, admission, routing, placement and the
KV hand-off protocol over N prefill and M decode units (or N colocated ones).

Actors only step their unit; what one asks of another goes through here (`pdserve.engine.actors.base.Port`):
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.engine.modes.adaptive.actors import AdaptiveDecodeActor, LendingPrefillActor
from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.admission import cached_prefix, uncached_tokens
from pdserve.engine.core.messages import Abort, KVHandoff, Preempted, Release, Request, Reservation
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.coordinator.faults import UnitFaults
from pdserve.engine.coordinator.planner import Decision, LoadState, Planner, Running, Stream
from pdserve.engine.coordinator.prefill_plans import Waiting
from pdserve.engine.coordinator.routing import DecodeView, PrefillView, decode_order, first_token_order
from pdserve.engine.coordinator.slo import MeasuredUnits

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
    def __init__(self, mode: str, prefill: list[Actor], decode: list[Actor], planner: Planner | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`prefill` and `decode` actors by unit index; colocated mode: its actors in `decode`, none in `prefill`.
        Adaptive mode decides with `planner` (None until the SLOs are known: every prompt stays local);
        `clock` is the time requests' arrival times are on (a simulator hands in its virtual one)."""
        self.mode = mode
        self.prefill, self.decode = list(prefill), list(decode)
        self.planner, self.clock = planner, clock
        self.table: dict[str, Route] = {}
        self.down: dict[str, str] = {}       # the unit faults (`faults.UnitFaults`): which units are down,
        self.retired: set[str] = set()       # which of them for good,
        self._parked: list[Preempted] = []   # and what waits for a prefill unit
        self._last_choice: dict[str, str] = {}
        self._lending: set[str] = set()             # the units stepping on lent cores now
        for actor in self.actors:
            actor.port, actor.clock = self, clock

    # admission
    def submit(self, request: Request) -> None:
        """Route a new request to the unit with the earliest predicted first token (raises NoUnitUp)."""
        entry = self.prefill if self.mode == "disaggregated" else self.decode
        index = self._first_token_unit(entry, request)
        if index is None:
            raise NoUnitUp("every unit that takes new requests is restarting after a failure; retry shortly")
        route = Route(prefill=index) if entry is self.prefill else Route(decode=index)
        self.table[request.request_id] = route
        entry[index].routed_prefill += 1
        entry[index].send(request)

    def _first_token_unit(self, actors: list[Actor], seq: Sequence | Request) -> int | None:
        if len(actors) == 1:
            return 0 if self.up(actors[0]) else None
        if isinstance(seq, Request):
            seq = Sequence(seq)
        order = first_token_order([PrefillView(i, _prefill_work(a), uncached_tokens(a.blocks, seq),
                                               self._prefill_rate(a, actors), self.up(a))
                                   for i, a in enumerate(actors)])
        return order[0] if order else None

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
        return decode_order([DecodeView(i, d.blocks.num_sequences + 1, self._step_after(d),
                                        len(cached_prefix(d.blocks, seq, seq.num_tokens)), self.up(d))
                             for i, d in enumerate(self.decode)])

    def _step_after(self, actor: Actor) -> float | None:
        """Its predicted step time with one more row: every sequence holding blocks there (reserved, landing,
        decoding) will decode in its steps."""
        rows = actor.blocks.num_sequences + 1
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
        index = self._first_token_unit(self.prefill, seq)
        route.prefill, route.decode, route.decoding = index, None, None
        if index is None:                       # no prefill unit up: it waits for one to come back
            self._parked.append(message)
            return
        self.prefill[index].routed_prefill += 1
        self.prefill[index].send(message)

    def blocks_freed(self, actor: Actor) -> None:
        for prefill in self.prefill:
            prefill.poke()

    # adaptive placement (Port): the planner decides, on the decode unit's queue now
    def place(self, actor: Actor, seq: Sequence) -> bool:
        """Whether decode unit `actor` prefills `seq` itself; else it goes to the prefill unit with the
        earliest predicted first token."""
        route = self.table.get(seq.request_id)
        index = self._first_token_unit(self.prefill, seq)
        if route is None or index is None or self.planner is None:   # aborted (its Abort follows), no prefill
            return True                                               # unit up, or not started
        prefill = self.prefill[index]
        decision = self.planner.place(uncached_tokens(actor.blocks, seq), uncached_tokens(prefill.blocks, seq),
                                      self._load(actor, prefill), actor.cost, prefill.cost, seq.num_tokens,
                                      _waited(seq, self.clock()))
        self._log("placement", decision)
        if decision.local:
            route.decode = actor.index
            return True
        route.prefill, route.decode = index, None
        prefill.routed_prefill += 1
        prefill.send(Preempted(seq.request, tuple(seq.output_token_ids)) if seq.output_token_ids else seq.request)
        return False

    def step_budget(self, actor: Actor, decode_rows: int) -> int | None:
        """Prefill tokens decode unit `actor`'s next step carries, as the planner predicts best (with no
        prompt queued there, no prediction: the step carries none whatever the budget)."""
        if self.planner is None:
            return None
        if not len(actor.local):
            return self.planner.max_prefill_tokens
        decision = self.planner.step_budget(self.load(actor, decode_rows), actor.cost)
        self._log("step budget", decision)
        return decision.chosen.chunk

    def prefill_budget(self, actor: Actor) -> int | None:
        """Prompt tokens prefill unit `actor`'s next step carries, as the planner predicts best (None: a full
        step, as before the planner has SLOs or the unit's steps are measured)."""
        threads = actor.share and actor.share.prefill_own
        if self.planner is None or actor.cost.coefficients(threads) is None:
            return None
        queue = _waiting(actor.scheduler.in_order(), self.clock())
        if len(queue) < 2:
            return None
        decision = self.planner.prefill_budget(queue, actor.cost, threads)
        self._log("prefill step", decision)
        return decision.chosen.chunk

    def step_threads(self, actor: Actor, batch, own: int, total: int) -> int:
        """Core lending: every core for `actor`'s step while the unit it borrows from idles, when the planner
        predicts the step faster so (and within the partner's SLO: the partner waits for it to end)."""
        if self.partner_busy(actor) or self.planner is None:
            return own
        slos, prefilling = self.planner.slos, actor in self.prefill
        rows = batch.decoding                                  # NOTE: verifying rows too, with their drafts
        context = sum(s.num_computed_tokens for s in rows)
        lend = self.planner.lend(actor.cost, own, total, len(rows), batch.chunk_tokens, context,
                                 slos.itl if prefilling else slos.ttft, batch.num_drafts, batch.chunk_pairs)
        if lend:
            self._lending.add(actor.unit_name)
        return total if lend else own

    def cores_lent(self, actor: Actor) -> bool:
        """Whether a unit of the other role steps on `actor`'s cores now: `actor` waits for that step to end
        (stepping beside it, three threads on two cores stalled a lent 64-token prefill step 12x, to 605 ms)."""
        others = self.decode if actor in self.prefill else self.prefill
        return any(other.unit_name in self._lending and self.up(other) for other in others)

    def cores_returned(self, actor: Actor) -> None:
        """`actor`'s step on lent cores ended: the units it borrowed from may step again."""
        if actor.unit_name not in self._lending:
            return
        self._lending.discard(actor.unit_name)
        for other in self.decode if actor in self.prefill else self.prefill:
            other.poke()

    def _lent(self, cost: StepCostModel, own: int, total: int, rows: int, tokens: int, context: int, partner_slo: float) -> int:
        return total if self.planner.lend(cost, own, total, rows, tokens, context, partner_slo) else own

    def learn_costs(self, measured: MeasuredUnits) -> None:
        """Each adaptive unit's cost model starts from the start-up profile of its role's first unit."""
        for actors, profile in ((self.decode, measured.decode), (self.prefill, measured.prefill)):
            for actor in actors:
                if isinstance(actor, (AdaptiveDecodeActor, LendingPrefillActor)):
                    actor.cost.learn_from(profile)

    def _log(self, what: str, decision: Decision) -> None:
        """Log a decision at debug level when its kind of action changes."""
        if self._last_choice.get(what) != decision.chosen.action:
            self._last_choice[what] = decision.chosen.action
            logger.debug("%s %s: %s", what, decision.chosen.action, decision.reason)

    def load(self, actor: Actor, decode_rows: int | None = None) -> LoadState:
        """What the planner reads for decode unit `actor`'s step budget: the least loaded live prefill unit."""
        live = [p for p in self.prefill if self.up(p)] or self.prefill
        return self._load(actor, min(live, key=_prefill_work), decode_rows)

    def _load(self, decode: AdaptiveDecodeActor, prefill: LendingPrefillActor,
              decode_rows: int | None = None) -> LoadState:
        now = self.clock()
        queue = _waiting(decode.local.sequences(), now)
        running = decode.scheduler.running
        rows = len(running) if decode_rows is None else decode_rows
        share, context = decode.share, sum(s.num_computed_tokens for s in running)
        decode_alone = prefill_alone = None
        if share is not None and self.planner is not None:     # the threads a step gets while its partner idles
            slos, tokens = self.planner.slos, self.planner.max_prefill_tokens
            decode_alone = self._lent(decode.cost, share.decode_own, share.total, rows, 0, context, slos.ttft)
            prefill_alone = self._lent(prefill.cost, share.prefill_own, share.total, 0, tokens, 0, slos.itl)
        prefilling = _prefill_steps(prefill, share and share.prefill_own)
        return LoadState(rows, queue, prefill.backlog_tokens(), share and share.decode_own, decode_alone,
                         share and (share.prefill_own if rows or queue else prefill_alone), prefill.busy,
                         remote_running=prefilling,
                         remote_running_for=now - prefill.step_started_at if prefilling else 0.0,
                         decode_context=context,
                         decode_remaining=max((s.params.max_tokens - len(s.output_token_ids) for s in running),
                                              default=0),
                         streams=tuple(self._stream(s, now) for s in running))

    def _stream(self, seq: Sequence, now: float) -> Stream:
        """What decoding `seq` has taken since the planner first saw it decode (fresh when it is not routed;
        ending when it finished, though its row is still in the step in flight)."""
        route, tokens = self.table.get(seq.request_id), len(seq.output_token_ids)
        remaining = 0 if seq.done else max(0, seq.params.max_tokens - tokens)
        if route is None:
            return Stream(remaining=remaining)
        if route.decoding is None:
            route.decoding = (now, tokens)
        since, first = route.decoding
        return Stream(tokens - first, now - since, remaining)

    def partner_busy(self, actor: Actor) -> bool:
        """Whether a unit of the other role has work (the one `actor` would borrow cores from, where lent)."""
        others = self.decode if actor in self.prefill else self.prefill
        return any(other.busy or not self.up(other) for other in others)    # a down unit's cores are not free


def _prefill_work(actor: Actor) -> int:
    """Prompt tokens `actor` has to prefill before a new prompt: its queue and its steps in flight."""
    return actor.backlog_tokens() + actor.prefill_tokens_in_flight


def _prefill_steps(actor: Actor, own_threads: int | None) -> tuple[Running, ...]:
    """The steps in flight on `actor` that prefill: its backlog leaves them out (their chunks are scheduled)."""
    return tuple(Running(tokens, step.batch.chunk_pairs, own_threads if step.threads is None else step.threads)
                 for step in actor.steps_in_flight if (tokens := step.batch.chunk_tokens))


def _waiting(seqs: Iterable[Sequence], now: float) -> tuple[Waiting, ...]:
    """Prompts queued for prefill as the planner sees them: tokens still to compute, seconds since arrival."""
    return tuple(Waiting(s.num_tokens - s.num_computed_tokens, _waited(s, now), s.num_tokens) for s in seqs)


def _waited(seq: Sequence, now: float) -> float:
    """Seconds since `seq`'s request arrived (0 for one that carries no arrival time)."""
    arrival = seq.request.arrival_time
    return max(0.0, now - arrival) if arrival > 0 else 0.0


def unit_cost(actor: Actor) -> tuple[StepCostModel, int | None] | None:
    """An adaptive actor's step cost model and the threads its own steps run on; None for other actors."""
    if isinstance(actor, LendingPrefillActor):
        return actor.cost, actor.share and actor.share.prefill_own
    if isinstance(actor, AdaptiveDecodeActor):
        return actor.cost, actor.share and actor.share.decode_own
    return None


def kind_median(actor: Actor, peers: list[Actor],
                read: Callable[[StepCostModel, int | None], float | None]) -> float | None:
    """`read` of the cost models of every unit of `actor`'s kind among `peers` (one device type, one thread
    count), their median: units of one kind differ only by their fits' noise, and two fits of the same CPU
    unit read a per-token rate 19x apart, which sent a conversation's next turn away from its prefix. None
    when `actor` has no cost model or none of its kind has measured it."""
    own = unit_cost(actor)
    if own is None:
        return None
    kind = (actor.device.type, own[1])
    readings = [value for peer in peers if (cost := unit_cost(peer)) is not None
                and (peer.device.type, cost[1]) == kind and (value := read(*cost)) is not None]
    return statistics.median(readings) if readings else None
