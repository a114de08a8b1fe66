"""The SLO planner of adaptive mode: one rule, from stated SLOs and measured step costs (docs/adaptive.md, "The
rule"). For each candidate action (local chunks, the whole queue local, waiting, a remote prefill, lending cores)
the step cost models predict the waiting prompts' first tokens and the decoding streams' steps; the planner takes
the action with the fewest predicted SLO misses (DistServe's goodput), among equals the least waiting it adds
(`decisions.best`), then the most tokens per second; a prompt whose local plan holds a decode step longer than a
typical prompt's TTFT SLO goes to the prefill unit wherever that adds no miss. Nothing here reads a clock: the
placement hands in how long each prompt has waited.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.modes.adaptive.decisions import Decision, LoadState, Prediction, Stream, best
from pdserve.engine.modes.adaptive.prefill_plans import PrefillPlan, StepsUpTo, Waiting, chunk_plan, fitting_plan
from pdserve.engine.coordinator.slo import Slos


class Planner:
    """Decides for decode units with the SLOs `slos`; every step cost comes from the models handed in."""

    def __init__(self, slos: Slos, max_prefill_tokens: int) -> None:
        self.slos = slos
        self.max_prefill_tokens = max_prefill_tokens      # NOTE: the runner's step size: a hard limit

    # the prefill a decode step carries
    def step_budget(self, state: LoadState, decode: StepCostModel) -> Decision:
        """How many prefill tokens the decode unit's next step carries for its local queue."""
        unmeasured = Prediction("local", self.max_prefill_tokens, 0, 0, 0.0, 0.0, 0.0)
        if not state.local_queue or decode.coefficients(state.local_threads) is None:
            return Decision(unmeasured)
        candidates = self._local_candidates(state.local_queue, state, decode, state.local_threads)
        return Decision(best(candidates), tuple(candidates))

    # where a new prompt is prefilled
    def place(self, local_tokens: int, remote_tokens: int, state: LoadState, decode: StepCostModel,
              prefill: StepCostModel | None, length: int = 0, waited: float = 0.0) -> Decision:
        """Prefill a new prompt of `length` tokens here (`local_tokens` to compute) or on the prefill unit
        (`remote_tokens`); `length` 0: the larger of the two. It arrived `waited` seconds ago: its first
        token counts from then, as every queued prompt's does. Where the local plan takes a decode step longer than
        a typical prompt's TTFT SLO, it goes to the prefill unit wherever that adds no predicted miss, though it
        would answer sooner here: every prompt arriving during that step, in no prediction, would be late."""
        if decode.coefficients(state.local_threads) is None:
            return Decision(Prediction("local", self.max_prefill_tokens, 0, 0, 0.0, 0.0, 0.0))
        length = length or max(local_tokens, remote_tokens)
        queue = (*state.local_queue, Waiting(local_tokens, waited, length))
        backlog = self._backlog(state, prefill)
        candidates = self._local_candidates(queue, state, decode, state.local_threads, backlog)
        remote = self._remote(remote_tokens, length, state, decode, prefill, waited)
        if remote is not None:
            candidates.append(remote)
        chosen = best(candidates)
        if remote is not None and chosen.action == "local" and chosen.step > self.slos.ttft and \
                remote.misses <= chosen.misses:
            chosen = remote
        return Decision(chosen, tuple(candidates))

    # the prompts a prefill unit's step carries
    def prefill_budget(self, queue: Sequence[Waiting], cost: StepCostModel, threads: int | None) -> Decision:
        """How many prompt tokens a prefill unit's next step carries for its `queue` (in the order it takes them):
        its whole step, which packs a chunk of the next prompt behind those it finishes, or only its first `k`
        prompts, whose first tokens then do not wait for what follows them (a prompt's 60-token tail packed
        with the next document's step-sized remainder gets its first token a whole step later)."""
        full = self.max_prefill_tokens
        candidates = [self._prefill_only(queue, chunk_plan(queue, full, 0, 0, cost, threads))]
        for k, end in _halving_prefixes(queue, full):
            first = chunk_plan(queue[:k], end, 0, 0, cost, threads)
            candidates.append(self._prefill_only(queue, first.then(chunk_plan(queue[k:], full, 0, 0, cost, threads)),
                                                 "first prompts"))
        return Decision(best(candidates), tuple(candidates))

    # lending cores
    def lend(self, cost: StepCostModel, own: int, total: int, decode_rows: int, prefill_tokens: int,
             context: int, partner_slo: float, drafts: int = 0, pairs: int | None = None) -> bool:
        """Whether a unit whose partner idles steps on `total` threads instead of its `own`: when that is
        predicted faster (unmeasured: try it; not tried for longer than its fit remembers, or not at a step
        this large: try it again, its fit only learns from lent steps), and the step stays within the
        partner's SLO (the partner's next work waits for it to end). `decode_rows` counts verifying rows,
        `drafts` their draft tokens; `pairs` the prompt chunks' attention pairs (None: a prompt's first chunk)."""
        if not cost.measured(own) or not cost.measured(total):
            return True
        borrowed = cost.predict(total, decode_rows, prefill_tokens, context, drafts, pairs)
        if borrowed > partner_slo:
            return False
        return (cost.stale(total) or not cost.covers(total, decode_rows, prefill_tokens)
                or borrowed < cost.predict(own, decode_rows, prefill_tokens, context, drafts, pairs))

    # predictions
    def _local_candidates(self, queue: Sequence[Waiting], state: LoadState, decode: StepCostModel,
                          threads: int | None, backlog: tuple[float, int] = (0.0, 0)) -> list[Prediction]:
        """Chunks that keep the ITL SLO, sized at each step's offsets into its prompts, and the whole queue
        in steps of up to `--max-prefill-tokens`; waiting, when the streams' ends are known."""
        whole = self._whole(queue)
        candidates = []
        rows, context = state.decode_rows, state.decode_context
        fitting = fitting_plan(queue, rows, context, decode, threads, self._chunk_limit(decode, threads),
                               self.max_prefill_tokens)
        if fitting is not None and fitting.chunk < whole:
            candidates.append(self._local(queue, fitting, state, decode, threads, backlog=backlog))
        candidates.append(self._local(queue, chunk_plan(queue, whole, rows, context, decode, threads), state, decode,
                                      threads, backlog=backlog))
        if state.decode_rows and state.decode_remaining and \
                all(w.waited <= self.slos.ttft_for(w.served) for w in queue):
            candidates.append(self._wait(queue, state, decode, threads, backlog))
        return candidates

    def _whole(self, queue: Sequence[Waiting]) -> int:
        """The chunk that prefills the whole queue at once: at most the runner's step size."""
        return min(max(1, sum(w.tokens for w in queue)), self.max_prefill_tokens)

    def _chunk_limit(self, decode: StepCostModel, threads: int | None) -> float:
        """The step a chunk is sized to: the ITL SLO; with every gap counted (`max`), within it as often as the
        cost model's recent predictions held (`overrun`): a mean absorbs a step's error as it does a step."""
        return self.slos.itl / (decode.overrun(threads) if self.slos.itl_kind == "max" else 1.0)

    def _local(self, queue: Sequence[Waiting], plan: PrefillPlan, state: LoadState, decode: StepCostModel,
               threads: int | None, delay: float = 0.0, backlog: tuple[float, int] = (0.0, 0)) -> Prediction:
        """The queue prefilled by `plan`'s steps after `delay` seconds, while the prefill unit works off its
        `backlog` (seconds, prompt tokens)."""
        rows, context = state.decode_rows, state.decode_context
        ttft_misses = self._ttft_misses(queue, plan, delay)
        horizon = delay + plan.seconds_until_done()
        itl_misses = self._itl_misses(state, decode, plan.runs)
        span = max(horizon, backlog[0])
        alone = decode.predict(threads, rows, 0, context) if rows else 0.0
        decoded = rows * plan.steps + (rows * (span - horizon) / alone if alone else 0.0)
        tokens = decoded + sum(w.served for w in queue) + backlog[1]
        stall = max(0.0, plan.seconds_until_done() - plan.steps * alone)
        return Prediction("local", plan.chunk, ttft_misses, itl_misses, tokens / span if span else 0.0, horizon,
                          plan.longest, rows, stall)

    def _ttft_misses(self, queue: Sequence[Waiting], plan: PrefillPlan, delay: float = 0.0) -> int:
        """The prompts of `queue` whose first token, `plan`'s steps after `delay` seconds, comes past the SLO."""
        return sum(w.waited + delay + plan.seconds_until(steps) > self.slos.ttft_for(w.served)
                   for w, steps in zip(queue, plan.finished))

    def _prefill_only(self, queue: Sequence[Waiting], plan: PrefillPlan, action: str = "prefill") -> Prediction:
        """The queue prefilled by `plan`'s steps on a unit that only prefills."""
        done = plan.seconds_until_done()
        rate = sum(w.served for w in queue) / done if done else 0.0
        return Prediction(action, plan.chunk, self._ttft_misses(queue, plan), 0, rate, done, plan.runs[0][1])

    def _wait(self, queue: Sequence[Waiting], state: LoadState, decode: StepCostModel,
              threads: int | None, backlog: tuple[float, int] = (0.0, 0)) -> Prediction:
        """No prefill while the streams decode; the whole queue once the longest may have ended."""
        rows = state.decode_rows
        alone = decode.predict(threads, rows, 0, state.decode_context)
        drained = replace(state, decode_rows=0, decode_context=0, decode_remaining=0)
        whole = chunk_plan(queue, self._whole(queue), 0, 0, decode, threads)
        later = self._local(queue, whole, drained, decode, threads, delay=state.decode_remaining * alone)
        span = max(later.first_token, backlog[0])
        tokens = rows * state.decode_remaining + sum(w.served for w in queue) + backlog[1]
        return Prediction("wait", 0, later.ttft_misses, 0, tokens / span, later.first_token, alone, rows)

    def _remote(self, tokens: int, length: int, state: LoadState, decode: StepCostModel,
                prefill: StepCostModel | None, waited: float) -> Prediction | None:
        """The prompt prefilled on the prefill unit after its backlog; the local queue meanwhile on the decode
        unit's own cores (the prefill unit is busy then). None when no step cost is measured for it."""
        cost = prefill if prefill is not None and prefill.coefficients(state.prefill_threads) is not None else decode
        if cost.coefficients(state.prefill_threads) is None:
            return None
        first_token = (self._busy_seconds(state, cost)
                       + chunk_plan((Waiting(tokens, length=length),), self.max_prefill_tokens, 0, 0, cost,
                                    state.prefill_threads).seconds_until_done())
        rows = state.decode_rows
        threads = state.decode_threads if decode.coefficients(state.decode_threads) is not None else \
            state.local_threads             # NOTE: its own cores not measured yet: predicted as it steps now
        step = decode.predict(threads, rows, 0, state.decode_context) if rows else 0.0
        ttft_misses = int(waited + first_token > self.slos.ttft_for(length))
        span, served = first_token, length + state.remote_backlog_tokens
        if state.local_queue:
            meanwhile = best(self._local_candidates(state.local_queue, replace(state, prefill_busy=True), decode,
                                                    threads))
            ttft_misses += meanwhile.ttft_misses
            step = max(step, meanwhile.step)
            served += sum(w.served for w in state.local_queue)
            span = max(span, meanwhile.first_token)
        rate = (served + (rows * span / step if step else 0.0)) / span if span else 0.0
        itl_misses = self._itl_misses(state, decode, ((math.ceil(first_token / step), step),) if step else ())
        alone = decode.predict(state.local_threads, rows, 0, state.decode_context) if rows else 0.0
        stall = math.ceil(first_token / step) * max(0.0, step - alone) if step else 0.0   # its own cores meanwhile
        return Prediction("remote", 0, ttft_misses, itl_misses, rate, first_token, step, rows, stall)

    def _itl_misses(self, state: LoadState, decode: StepCostModel, steps: Sequence[tuple[int, float]]) -> int:
        """The decoding streams whose mean time between tokens the action's `steps` ((how many, seconds each),
        in order) put past the ITL SLO, where decode-only steps would not have (see the module docstring)."""
        if not state.decode_rows:
            return 0
        alone = decode.predict(state.local_threads, state.decode_rows, 0, state.decode_context)
        fresh = Stream(remaining=state.decode_remaining or None)
        streams = (*state.streams[:state.decode_rows], *[fresh] * (state.decode_rows - len(state.streams)))
        upto = StepsUpTo(steps, alone)
        return sum(self._misses_itl(stream, alone, upto) for stream in streams)

    def _misses_itl(self, stream: Stream, alone: float, upto: StepsUpTo) -> bool:
        if stream.remaining == 0:
            return False
        remaining = stream.remaining or 1
        added, longest = upto(remaining)
        if self.slos.itl_kind == "max":   # any one gap: a step it waits for past the SLO (and past decoding alone)
            return longest > max(self.slos.itl, alone)
        tokens = stream.gaps + remaining
        decode_only = stream.spent + remaining * alone
        return added > 0 and (decode_only + added) / tokens > max(self.slos.itl, decode_only / tokens)

    def _backlog(self, state: LoadState, prefill: StepCostModel | None) -> tuple[float, int]:
        """The seconds the prefill unit is predicted busy with its steps in flight and its queue whatever this
        decision, and its queue's tokens."""
        if prefill is None or prefill.coefficients(state.prefill_threads) is None:
            return 0.0, 0
        return self._busy_seconds(state, prefill), state.remote_backlog_tokens

    def _busy_seconds(self, state: LoadState, cost: StepCostModel) -> float:
        """Until the prefill unit could start a new prompt: what is left of its steps in flight (predicted, less
        the time the oldest has run), then its queue."""
        running = sum(cost.predict(r.threads, 0, r.tokens, pairs=r.pairs) for r in state.remote_running)
        left = max(0.0, running - state.remote_running_for)
        return left + self._prefill_seconds(state.remote_backlog_tokens, cost, state.prefill_threads)

    def _prefill_seconds(self, tokens: int, cost: StepCostModel, threads: int | None) -> float:
        """A backlog of `tokens` prefilled in steps of at most `--max-prefill-tokens`, each priced as its prompt's
        first chunk (the prompts' lengths are not read)."""
        full, last = divmod(tokens, self.max_prefill_tokens)
        seconds = full * cost.predict(threads, 0, self.max_prefill_tokens)
        return seconds + (cost.predict(threads, 0, last) if last else 0.0)


def _halving_prefixes(queue: Sequence[Waiting], most: int) -> list[tuple[int, int]]:
    """(k, tokens) of the first k prompts of `queue` taken whole in a step of under `most` tokens (the rest
    left behind): the most such prompts, then each prefix of at most half the tokens of the last one kept. A
    candidate per prompt, each O(queue), made a decision over a long queue of short prompts slow."""
    ends = list(itertools.takewhile(lambda item: item[1] < most,
                                    enumerate(itertools.accumulate(max(1, w.tokens) for w in queue[:-1]), 1)))
    kept = []
    for k, end in reversed(ends):
        if not kept or end <= kept[-1][1] / 2:
            kept.append((k, end))
    return kept
