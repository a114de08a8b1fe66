"""The adaptive mode's decisions, asked by its actors: whether a decode unit prefills a new prompt itself or sends
it to a prefill unit, how many prompt tokens each step carries, and whose cores a step runs on. The SLO planner
(`planner.py`) predicts; this reads the units' views (`engine.actors.view`) and the coordinator's routes."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.actors.base import Actor
from pdserve.engine.actors.view import Decoding, Queued
from pdserve.engine.coordinator.coordinator import Coordinator
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.modes.adaptive.decisions import Decision, LoadState, Running, Stream
from pdserve.engine.modes.adaptive.planner import Planner
from pdserve.engine.modes.adaptive.prefill_plans import Waiting
from pdserve.engine.units.spec import CoreShare

logger = logging.getLogger(__name__)

STEADY_STEPS = 16     # decode-only steps of one row count that reuse one lending answer (context grows a token a row)


@dataclass(slots=True)
class SteadyLending:
    """The lending answer of a decode-only step of `rows` rows, kept for the next `steps_left` such steps: asking
    the planner solves the cost model's fit again after every observed step, host work a one-row step feels."""

    rows: int
    lend: bool
    steps_left: int


class Placement:
    def __init__(self, coordinator: Coordinator, share: CoreShare | None) -> None:
        self.coordinator, self.share = coordinator, share
        self.planner: Planner | None = None        # None until the SLOs are known: every prompt stays local
        self._last_choice: dict[str, str] = {}
        self._steady: dict[str, SteadyLending] = {}

    def place(self, actor: Actor, seq: Sequence) -> bool:
        """Whether decode unit `actor` prefills `seq` itself; else it goes to the prefill unit with the earliest
        predicted first token."""
        c = self.coordinator
        route = c.table.get(seq.request_id)
        index = c.first_token_unit(c.prefill, seq)
        if route is None or index is None or self.planner is None:   # aborted (its Abort follows), no prefill
            return True                                               # unit up, or not started
        prefill = c.prefill[index]
        decision = self.planner.place(actor.uncached_tokens(seq), prefill.uncached_tokens(seq),
                                      self._load(actor, prefill), actor.priced()[0], prefill.priced()[0],
                                      seq.num_tokens, waited(seq.request.arrival_time, c.clock()))
        self._log("placement", decision)
        if decision.local:
            route.decode = actor.index
            return True
        c.prefill_on(index, seq)
        return False

    def step_budget(self, actor: Actor, decode_rows: int) -> int | None:
        """Prefill tokens decode unit `actor`'s next step carries, as the planner predicts best (with no prompt
        queued there, no prediction: the step carries none whatever the budget)."""
        if self.planner is None:
            return None
        if not actor.queue_lengths()[1]:                     # no prompt waits there for its prefill
            return self.planner.max_prefill_tokens
        decision = self.planner.step_budget(self.load(actor, decode_rows), actor.priced()[0])
        self._log("step budget", decision)
        return decision.chosen.chunk

    def prefill_budget(self, actor: Actor) -> int | None:
        """Prompt tokens prefill unit `actor`'s next step carries, as the planner predicts best (None: a full
        step, as before the planner has SLOs or the unit's steps are measured)."""
        cost, threads = actor.priced()
        if self.planner is None or cost.coefficients(threads) is None:
            return None
        queue = self._waiting(actor.queued())
        if len(queue) < 2:
            return None
        decision = self.planner.prefill_budget(queue, cost, threads)
        self._log("prefill step", decision)
        return decision.chosen.chunk

    def step_threads(self, actor: Actor, batch: Batch, own: int, total: int) -> int:
        """Core lending: every core for `actor`'s step while the unit it borrows from idles, when the planner
        predicts the step faster so (and within the partner's SLO: the partner waits for it to end)."""
        if self.partner_busy(actor) or self.planner is None:
            return own
        rows = batch.decoding                                  # NOTE: verifying rows too, with their drafts
        steady = not batch.chunk_tokens and not batch.num_drafts
        kept = self._steady.get(actor.unit_name) if steady else None
        if kept is not None and kept.rows == len(rows) and kept.steps_left:
            kept.steps_left -= 1
            lend = kept.lend
        else:
            context = sum(s.num_computed_tokens for s in rows)
            lend = self.planner.lend(actor.priced()[0], own, total, len(rows), batch.chunk_tokens, context,
                                     self.partner_slo(actor), batch.num_drafts, batch.chunk_pairs)
            if steady:
                self._steady[actor.unit_name] = SteadyLending(len(rows), lend, STEADY_STEPS - 1)
        if lend:
            self.coordinator.lending.add(actor.unit_name)
        return total if lend else own

    def partner_slo(self, actor: Actor) -> float:
        """The bound on a step `actor` runs on its idle partner's cores: what waits for it there. A decode partner
        idles with no stream, so what waits is a prompt's first token (TTFT), unless another prefill unit can
        hand it a stream meanwhile, whose next token would wait (ITL)."""
        slos = self.planner.slos
        return slos.itl if actor in self.coordinator.prefill and len(self.coordinator.prefill) > 1 else slos.ttft

    def cores_lent(self, actor: Actor) -> bool:
        """Whether a unit of the other role steps on `actor`'s cores now: `actor` waits for that step to end
        (stepping beside it oversubscribes the cores, which stalls the lent step many times over)."""
        c = self.coordinator
        return any(other.unit_name in c.lending and c.up(other) for other in c.partners(actor))

    def cores_returned(self, actor: Actor) -> None:
        self.coordinator.cores_returned(actor)

    def partner_busy(self, actor: Actor) -> bool:
        """Whether a unit of the other role has work (the one `actor` would borrow cores from, where lent)."""
        c = self.coordinator
        return any(other.busy or not c.up(other) for other in c.partners(actor))   # a down unit's cores are not free

    def load(self, actor: Actor, decode_rows: int | None = None) -> LoadState:
        """What the planner reads for decode unit `actor`'s step budget: the least loaded live prefill unit."""
        c = self.coordinator
        live = [p for p in c.prefill if c.up(p)] or c.prefill
        return self._load(actor, min(live, key=lambda p: p.prefill_work()), decode_rows)

    def _load(self, decode: Actor, prefill: Actor, decode_rows: int | None = None) -> LoadState:
        now, share = self.coordinator.clock(), self.share
        running = decode.decoding()
        rows = len(running) if decode_rows is None else decode_rows
        context = sum(row.context for row in running)
        decode_alone = prefill_alone = None
        if share is not None and self.planner is not None:     # the threads a step gets while its partner idles
            slos, tokens = self.planner.slos, self.planner.max_prefill_tokens
            decode_alone = self._lent(decode, share.decode_own, rows, 0, context, slos.ttft)
            prefill_alone = self._lent(prefill, share.prefill_own, 0, tokens, 0, self.partner_slo(prefill))
        queue = self._waiting(decode.queued())
        own = share and share.prefill_own
        prefilling = tuple(Running(s.tokens, s.pairs, own if s.threads is None else s.threads)
                           for s in prefill.prefill_steps())
        return LoadState(rows, queue, prefill.backlog_tokens(), share and share.decode_own, decode_alone,
                         share and (share.prefill_own if rows or queue else prefill_alone), prefill.busy,
                         remote_running=prefilling,
                         remote_running_for=now - prefill.step_started_at if prefilling else 0.0,
                         decode_context=context,
                         decode_remaining=max((row.max_tokens - row.output_tokens for row in running), default=0),
                         streams=tuple(self._stream(row, now) for row in running))

    def _lent(self, actor: Actor, own: int, rows: int, tokens: int, context: int, partner_slo: float) -> int:
        cost, total = actor.priced()[0], self.share.total
        return total if self.planner.lend(cost, own, total, rows, tokens, context, partner_slo) else own

    def _stream(self, row: Decoding, now: float) -> Stream:
        """What decoding `row` has taken since the planner first saw it decode (fresh when it is not routed;
        ending when it finished, though its row is still in the step in flight)."""
        route = self.coordinator.table.get(row.request_id)
        remaining = 0 if row.done else max(0, row.max_tokens - row.output_tokens)
        if route is None:
            return Stream(remaining=remaining)
        if route.decoding is None:
            route.decoding = (now, row.output_tokens)
        since, first = route.decoding
        return Stream(row.output_tokens - first, now - since, remaining)

    def _waiting(self, queued: tuple[Queued, ...]) -> tuple[Waiting, ...]:
        """Prompts queued for prefill as the planner sees them: tokens still to compute, seconds since arrival."""
        now = self.coordinator.clock()
        return tuple(Waiting(q.tokens, waited(q.arrival, now), q.length) for q in queued)

    def _log(self, what: str, decision: Decision) -> None:
        """Log a decision at debug level when its kind of action changes."""
        if self._last_choice.get(what) != decision.chosen.action:
            self._last_choice[what] = decision.chosen.action
            logger.debug("%s %s: %s", what, decision.chosen.action, decision.reason)


def waited(arrival: float, now: float) -> float:
    """Seconds since a request arrived at `arrival` (0 for one that carries no arrival time)."""
    return max(0.0, now - arrival) if arrival > 0 else 0.0
