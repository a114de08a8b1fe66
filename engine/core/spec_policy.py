"""Where drafts pay: per step, from the measured cost of verifying them and the ITL SLO; per row, from its
acceptance.

A step takes candidate drafts best first (largest a^j: a row's acceptance a to the power of the draft's
position j) while each raises the step's expected tokens per second and the step's predicted time stays within
max(T0, min(ITL SLO, HEADROOM * T1)), T0 the step without drafts and T1 a lone row's plain step; a step carrying
prefill chunks drafts nothing. docs/speculative.md ("When a step drafts, and how long") gives the reasons.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pdserve.engine.core.config import SLO_HEADROOM as HEADROOM
from pdserve.engine.core.weighted_fit import WeightedFit

# NOTE: a decode step reads every weight once whatever its tokens; while rows * (1 + K) stay under a
# CPU's flop/byte ridge (a few dozen tokens for bf16 matmuls streaming their weights from memory) a
# verification costs about one plain step. Used only until a step cost is measured.
FLAT_STEP_TOKENS = 32
ACCEPTANCE_DECAY = 0.8       # weight of a row's older verifications in its acceptance estimate
FIT_DECAY = 0.97             # DecodeStepFit: as the step cost model (engine.actors.step_cost)
FIT_RIDGE = 1e-3
# A shape's time counts this many decode steps after it last ran: a shape avoided for its cost is tried again
# (one long step) at most once in that many steps, which a p99 ITL (1 in 100) does not read.
SHAPE_MEMORY_STEPS = 200


class StepCost(Protocol):
    """The step cost model (engine.actors.step_cost.StepCostModel): seconds of one step."""

    def predict(self, threads: int, decode_rows: int, prefill_tokens: int, context: int = 0,
                drafts: int = 0, pairs: int | None = None) -> float | None: ...

    def observe(self, threads: int, decode_rows: int, prefill_tokens: int, seconds: float, context: int = 0,
                drafts: int = 0, pairs: int | None = None) -> None: ...


@dataclass(slots=True)
class Acceptance:
    """Accepted drafts over positions tried (an accepted one, or the first rejected), decayed per verification."""

    hits: float = 0.0
    trials: float = 0.0
    decay: float = ACCEPTANCE_DECAY

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.hits = self.decay * self.hits + num_accepted
        self.trials = self.decay * self.trials + num_accepted + (num_accepted < num_drafts)

    def rate(self, prior: float) -> float:
        """The per-position acceptance probability, with `prior` counted as one trial."""
        return (self.hits + prior) / (self.trials + 1.0)


@dataclass(slots=True)
class DecodeStepFit:
    """Seconds of a decode-only step = fixed + per row x rows + per draft x draft tokens - a one-token step's
    discount, one exponentially weighted least-squares fit per thread count, from the steps this unit ran.

    The discount: a step of one token runs every projection as a matrix-vector product, the CPU kernels'
    one-row path, which streams weights faster than their path for several rows (engine/kernels
    native_linear), so a lone row's first draft costs more than the ones after it."""

    _fits: dict[int | None, WeightedFit] = field(default_factory=dict)

    def observe(self, threads: int | None, rows: int, drafts: int, seconds: float) -> None:
        fit = self._fits.setdefault(threads, WeightedFit(4, FIT_DECAY, FIT_RIDGE))
        fit.observe(np.array([1.0, rows, drafts, -float(rows + drafts == 1)]), seconds)

    def coefficients(self, threads: int | None) -> np.ndarray | None:
        """(fixed, per row, per draft token, one-token discount) seconds at `threads`, or None before three steps there or while
        no recent step verified a draft (its weighted sum of squared draft counts under one: a cost measured
        once, say in a step slowed by something else, must not keep the gate shut for good)."""
        fit = self._fits.get(threads)
        if fit is None or fit.observations < 3 or fit.weight(2) < 1.0:
            return None
        return fit.coefficients()


@dataclass(slots=True)
class ShapeTimes:
    """Each decode step shape's time by its positions (rows plus draft tokens, the rows of x every projection
    multiplies), exponentially weighted per shape, one table per thread count; a shape counts while it ran
    within the last SHAPE_MEMORY_STEPS decode steps."""

    _times: dict[int | None, dict[int, tuple[float, float, int]]] = field(default_factory=dict)
    _steps: int = 0

    def observe(self, threads: int | None, positions: int, seconds: float) -> None:
        self._steps += 1
        table = self._times.setdefault(threads, {})
        mean, weight, _ = table.get(positions, (0.0, 0.0, 0))
        weight = FIT_DECAY * weight + 1.0
        table[positions] = (mean + (seconds - mean) / weight, weight, self._steps)

    def widest(self, threads: int | None) -> int:
        """The most positions a step at `threads` has had (0: none yet)."""
        return max(self._times.get(threads, {0: None}))

    def seconds(self, threads: int | None, positions: int) -> float | None:
        """The measured time of a step of `positions` at `threads`, or None (never, or not lately)."""
        entry = self._times.get(threads, {}).get(positions)
        if entry is None or self._steps - entry[2] > SHAPE_MEMORY_STEPS:
            return None
        return entry[0]


@dataclass(frozen=True, slots=True)
class StepBudget:
    """A step's predicted seconds without drafts, seconds per verified draft token, and the most seconds
    the step may take with its drafts; `plain` None when nothing is measured yet (a roofline guess drafts)."""

    plain: float | None = None
    per_draft: float = 0.0
    limit: float = math.inf
    first: float = 0.0              # what a step's first draft costs beyond per_draft (a lone row's discount lost)
    measured: tuple[float | None, ...] = ()   # [d]: the measured seconds of this step with d drafts, if it ran lately

    def seconds(self, drafts: int) -> float:
        """The step's predicted seconds with `drafts` draft tokens: measured where that shape ran lately, else
        the nearest measured shape below it (or the plain step) plus the linear price of the drafts between."""
        if drafts < len(self.measured) and self.measured[drafts] is not None:
            return self.measured[drafts]
        below = next((d for d in range(min(drafts, len(self.measured)) - 1, 0, -1)
                      if self.measured[d] is not None), 0)
        base = self.measured[below] if below else self.plain + (self.first if drafts else 0.0)
        return base + self.per_draft * (drafts - below)


def draft_length(rate: float, threshold: float, cap: int) -> int:
    """The longest j <= cap with rate ** j > threshold."""
    if threshold <= 0.0 or rate >= 1.0:
        return cap
    if rate <= threshold:
        return 0
    return min(cap, math.ceil(math.log(threshold) / math.log(rate)) - 1)


def allot(rates: Sequence[float], caps: Sequence[int], rows: int, budget: StepBudget) -> list[int]:
    """Draft lengths for the drafting rows (acceptance `rates`, at most `caps`) of a step of `rows` decode
    rows: candidates best first while each raises the step's expected tokens per second and the step stays
    within `budget.limit`, kept if they beat the step without drafts (the first draft also costs
    `budget.first`); then every drafting row left without one gets a probe of one where time allows."""
    lengths = [0] * len(rates)
    if budget.plain is None:
        return list(caps)
    drafts, seconds, tokens = 0, budget.plain + budget.first, float(rows)
    best = [(-rate, i, rate) for i, (rate, cap) in enumerate(zip(rates, caps)) if cap > 0]
    heapq.heapify(best)
    while best:
        _, i, gain = best[0]
        longer = budget.seconds(drafts + 1)
        if longer > budget.limit or gain * seconds <= (longer - seconds) * tokens:
            break                                      # too long, or it would lower the step's rate
        drafts, seconds, tokens, lengths[i] = drafts + 1, longer, tokens + gain, lengths[i] + 1
        if lengths[i] < caps[i]:
            heapq.heapreplace(best, (-gain * rates[i], i, gain * rates[i]))
        else:
            heapq.heappop(best)
    if tokens * budget.plain <= rows * seconds:        # no better than no drafts at all
        lengths, drafts = [0] * len(rates), 0
    for i, cap in enumerate(caps):                     # NOTE: a probe keeps a row's acceptance measured
        if cap > 0 and not lengths[i] and budget.seconds(drafts + 1) <= budget.limit:
            drafts, lengths[i] = drafts + 1, 1
    return lengths


class DraftGate:
    """Each step's budget for drafts (`budget`), or None: no drafts this step."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None) -> None:
        self.k = num_speculative_tokens
        self.max_rows = disable_by_batch_size
        self.cost: StepCost | None = None
        self.learns = False
        self.threads: int | None = None
        self.fit = DecodeStepFit()
        self.shapes = ShapeTimes()
        self.itl_slo: float | None = None      # seconds; the engine's ITL SLO once known (`serve`)
        self.draft_forward: float | None = None    # a draft model's measured seconds per forward, if any

    def use(self, cost: StepCost, learns: bool) -> None:
        """Predict from `cost` until this unit's own fit has measured its steps; `learns`: this gate feeds
        it the steps it observes (else its owner does)."""
        self.cost, self.learns = cost, learns

    def serve(self, itl_slo: float | None) -> None:
        """Bound each step's added verification time by the ITL SLO (seconds; None: no bound)."""
        self.itl_slo = itl_slo

    def observe_step(self, decode_rows: int, tokens: int, seconds: float, threads: int, drafts: int | None = None,
                     pairs: int = 0) -> None:
        """A step of `decode_rows` rows and `tokens` more (prefill or draft tokens); `drafts`: its draft
        tokens when it carried no prefill (it then feeds this unit's own fit of decode steps); `pairs`: its
        prompt chunks' attention pairs."""
        self.threads = threads
        if self.cost is not None and self.learns:
            self.cost.observe(threads, decode_rows, tokens if drafts is None else 0, seconds, drafts=drafts or 0,
                              pairs=pairs)
        if drafts is not None and decode_rows:
            self.fit.observe(threads, decode_rows, drafts, seconds)
            self.shapes.observe(threads, decode_rows + drafts, seconds)

    def budget(self, rows: int, prefill_tokens: int) -> StepBudget | None:
        if prefill_tokens > 0 or rows <= 0 or (self.max_rows is not None and rows > self.max_rows):
            return None
        plain, per_draft, first = self._predicted(rows)
        per_draft += self.draft_forward or 0.0         # NOTE: one draft forward per draft token (exact for one row)
        if plain is None:
            return StepBudget() if rows <= max(1, FLAT_STEP_TOKENS // (1 + self.k)) else None
        if rows * (per_draft + first) >= plain:
            return None                                # no draft can raise the step's rate
        plain = self._measured_plain(rows) or plain
        slo = math.inf if self.itl_slo is None else self.itl_slo
        lone = plain if rows == 1 else self._measured_plain(1) or self._predicted(1)[0] or 0.0
        return StepBudget(plain, per_draft, max(plain, min(slo, HEADROOM * lone)), first, self._measured(rows))

    def _measured_plain(self, rows: int) -> float | None:
        """A step of `rows` rows without drafts as measured lately (`ShapeTimes`), or None."""
        return None if self.draft_forward else self.shapes.seconds(self.threads, rows)

    def _measured(self, rows: int) -> tuple[float | None, ...]:
        """[d]: the measured seconds of a step of `rows` rows and d drafts (d up to the step's k per row),
        where a step of that many positions ran lately (`ShapeTimes`), else None."""
        if self.draft_forward:
            return ()                                  # NOTE: a draft model's forwards are not in the step's time
        most = min(rows * self.k, self.shapes.widest(self.threads) - rows)
        measured = tuple(self.shapes.seconds(self.threads, rows + d) for d in range(most + 1))
        last = max((d for d, t in enumerate(measured) if t is not None), default=-1)
        return measured[:last + 1]

    def threshold(self, rows: int, prefill_tokens: int) -> float | None:
        """The acceptance probability a lone draft token of this step must beat (D * c / T0), or None."""
        budget = self.budget(rows, prefill_tokens)
        if budget is None:
            return None
        return 0.0 if budget.plain is None else rows * (budget.per_draft + budget.first) / budget.plain

    def _predicted(self, rows: int) -> tuple[float | None, float, float]:
        """(seconds of the step without drafts, seconds per verified draft token, the first draft's extra),
        or (None, 0, 0) unmeasured."""
        own = self.fit.coefficients(self.threads)
        if own is not None:
            first = float(own[3]) if rows == 1 else 0.0
            return float(own[0] + own[1] * rows) - first, float(own[2]), first
        if self.cost is None:
            return None, 0.0, 0.0
        plain = self.cost.predict(self.threads, rows, 0)
        full = self.cost.predict(self.threads, rows, 0, drafts=self.k)
        if plain is None or full is None or plain <= 0.0:
            return None, 0.0, 0.0
        return plain, max(full - plain, 0.0) / self.k, 0.0
