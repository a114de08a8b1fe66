"""Where drafts pay: per step, from the predicted cost of verifying them; per row, from its acceptance.

A step of D decode rows yields D tokens in T0 seconds (the step cost model's prediction without
drafts). Verifying one more draft token adds c seconds to that step (the model's marginal cost of a
verified token) and yields, for a row that accepts each draft with probability a, a^j expected
tokens at draft position j. The j-th draft is worth verifying when it yields tokens at a better rate
than the step does: a^j / c > D / T0, i.e. a^j > D * c / T0 (the step's threshold). So a row drafts
the longest j with a^j above the threshold: long drafts where acceptance is high and steps are
cheap, none once D * c / T0 reaches 1 (large or compute-bound steps).

A step that carries prefill chunks drafts nothing: it is already the long step whose wait sets the
short streams' tail ITL, and the verifying rows would take the chunk path next to it.

Before the cost model has measured anything, a step drafts when it has at most
FLAT_STEP_TOKENS // (1 + K) rows (a roofline guess); `disable_by_batch_size` stays a hard limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

# NOTE: a decode step reads every weight once whatever its tokens; while rows * (1 + K) stay under the
# CPU's flop/byte ridge (~32 tokens for bf16 matmuls on AVX-512 cores at ~20 GB/s) a verification
# costs about one plain step. Used only until the step cost model has measured steps.
FLAT_STEP_TOKENS = 32
ACCEPTANCE_DECAY = 0.8       # weight of a row's older verifications in its acceptance estimate


class StepCost(Protocol):
    """The step cost model (engine.actors.step_cost.StepCostModel): seconds of one step."""

    def predict(self, threads: int, decode_rows: int, prefill_tokens: int) -> float | None: ...

    def observe(self, threads: int, decode_rows: int, prefill_tokens: int, seconds: float) -> None: ...


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


def draft_length(rate: float, threshold: float, cap: int) -> int:
    """The longest j <= cap with rate ** j > threshold."""
    if threshold <= 0.0 or rate >= 1.0:
        return cap
    if rate <= threshold:
        return 0
    return min(cap, math.ceil(math.log(threshold) / math.log(rate)) - 1)


class DraftGate:
    """Each step's threshold on a draft token's acceptance probability, or None: no drafts this step."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None) -> None:
        self.k = num_speculative_tokens
        self.max_rows = disable_by_batch_size
        self.cost: StepCost | None = None
        self.learns = False
        self.threads: int | None = None

    def use(self, cost: StepCost, learns: bool) -> None:
        """Predict from `cost`; `learns`: this gate feeds it the steps it observes (else its owner does)."""
        self.cost, self.learns = cost, learns

    def observe_step(self, decode_rows: int, tokens: int, seconds: float, threads: int) -> None:
        self.threads = threads
        if self.cost is not None and self.learns:
            self.cost.observe(threads, decode_rows, tokens, seconds)

    def threshold(self, rows: int, prefill_tokens: int) -> float | None:
        if prefill_tokens > 0 or rows <= 0 or (self.max_rows is not None and rows > self.max_rows):
            return None
        plain, marginal = self._predicted(rows)
        if plain is None:
            return 0.0 if rows <= max(1, FLAT_STEP_TOKENS // (1 + self.k)) else None
        threshold = rows * marginal / plain
        return threshold if threshold < 1.0 else None

    def _predicted(self, rows: int) -> tuple[float | None, float]:
        """(seconds of the step without drafts, seconds per verified draft token), or (None, 0) unmeasured."""
        if self.cost is None:
            return None, 0.0
        plain = self.cost.predict(self.threads, rows, 0)
        full = self.cost.predict(self.threads, rows, self.k)
        if plain is None or full is None or plain <= 0.0:
            return None, 0.0
        return plain, max(full - plain, 0.0) / self.k
