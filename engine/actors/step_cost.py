"""The step cost model: seconds of one step on one compute unit, fit online from the steps it ran.

    seconds = fixed + per_decode_row x D + per_prefill_token x (P + V) + per_context_token x K
              + prompt_path x [P > 0] + per_pair x A

`D` rows decoding, `P` prompt tokens prefilled, `V` draft tokens verified, `K` KV tokens the decoding rows
read (their contexts), `A` the query-key pairs the prompt chunks' attention reads (a chunk of n tokens after
`start` computed ones: n x start + n(n + 1) / 2). A step that prefills also pays a price per step for its prompt
path (its first token's logits): without that term a fit fed short chunks overpriced each token and one fed
long chunks underpriced short ones. Without `A`, a chunk at the end of a long prompt, priced like one at its
start, ran past the ITL SLO it was sized to (bench/RESULTS.md, "Serving modes"). One fit
per CPU thread count, so a step on borrowed cores is predicted from steps that ran on as many: core
sharing is measured, not assumed. The adaptive actors feed it; the coordinator's planner reads it.
"""
from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.engine.core.batch import attention_pairs
from pdserve.engine.core.weighted_fit import WeightedFit

CONTEXT_UNIT = 1000.0        # K is fit in thousands of tokens, A in millions: the ridge term then weighs them alike
PAIRS_UNIT = CONTEXT_UNIT ** 2
FEATURES = 6
COVERING_STEPS = 2          # remembered steps at least as large that a prediction for a step needs (`covers`)


@dataclass(slots=True)
class StepCostModel:
    """Seconds of one step on one compute unit, fit by exponentially weighted least squares."""

    decay: float = 0.97
    ridge: float = 1e-3
    _fits: dict[int | None, WeightedFit] = field(default_factory=dict)
    _prefill_steps: dict[int | None, int] = field(default_factory=dict)    # observed steps that carried prefill
    _observed: int = 0                                                    # steps observed, every thread count
    _last_observed: dict[int | None, int] = field(default_factory=dict)   # threads -> _observed at its latest
    _recent_shapes: dict[int | None, deque] = field(default_factory=dict)  # threads -> (rows, tokens) it remembers
    _overruns: dict[int | None, deque] = field(default_factory=dict)      # threads -> measured / predicted, prefills

    def observe(self, threads: int | None, decode_rows: int, prefill_tokens: int, seconds: float,
                context: int = 0, drafts: int = 0, pairs: int | None = None) -> None:
        """One step's seconds; `pairs` None: its prefill is one prompt's first chunk (see `predict`)."""
        fit = self._fits.setdefault(threads, WeightedFit(FEATURES, self.decay, self.ridge))
        features = _features(decode_rows, prefill_tokens, context, drafts, pairs)
        if prefill_tokens and fit.observations >= FEATURES:
            predicted = float(fit.coefficients() @ features)
            if predicted > 0:
                self._overruns.setdefault(threads, deque(maxlen=math.ceil(self.memory))).append(seconds / predicted)
        fit.observe(features, seconds)
        self._observed += 1
        self._last_observed[threads] = self._observed
        shapes = self._recent_shapes.setdefault(threads, deque(maxlen=math.ceil(self.memory)))
        shapes.append((decode_rows, prefill_tokens))
        if prefill_tokens:
            self._prefill_steps[threads] = self._prefill_steps.get(threads, 0) + 1

    def learn_from(self, profile: "StepCostModel") -> None:
        """Start from what `profile` observed (the start-up profile's shapes separate the coefficients, which a
        few serving steps alone do not); the steps observed after it weigh more as its observations decay. Not
        its overruns: each was measured against the fit of the profile steps before it, half grown, so they say
        how much the profile had still to learn, not how far a served step runs past a fitted prediction."""
        for threads, fit in profile._fits.items():
            self._fits[threads] = copy.deepcopy(fit)
        self._prefill_steps.update(profile._prefill_steps)
        self._observed = max(self._observed, profile._observed)
        self._last_observed.update(profile._last_observed)
        self._recent_shapes.update({t: copy.copy(shapes) for t, shapes in profile._recent_shapes.items()})

    @property
    def memory(self) -> float:
        """The steps a fit remembers: 1 / (1 - decay), the weight of all its observations."""
        return 1.0 / (1.0 - self.decay)

    def measured(self, threads: int | None) -> bool:
        """At least three steps observed at `threads` (a fit of its own, not another count's)."""
        fit = self._fits.get(threads)
        return fit is not None and fit.observations >= 3

    def stale(self, threads: int | None) -> bool:
        """More steps observed at other thread counts since the latest at `threads` than a fit remembers
        (1 / (1 - decay) steps): its prediction is older than the one it is compared with."""
        last = self._last_observed.get(threads)
        return last is not None and self._observed - last > self.memory

    def covers(self, threads: int | None, decode_rows: int, prefill_tokens: int) -> bool:
        """Whether `COVERING_STEPS` of the steps the fit at `threads` still remembers (its last `memory`) reached
        this many decode rows, and as many this many prefill tokens: beyond them its prediction extrapolates
        coefficients no step separated (one-row decode steps and prefill chunks mispredict a large batch's
        step), and one step is no measure (a noisy one decided every lending after it)."""
        shapes = self._recent_shapes.get(threads, ())
        return (sum(rows >= decode_rows for rows, _ in shapes) >= COVERING_STEPS
                and sum(tokens >= prefill_tokens for _, tokens in shapes) >= COVERING_STEPS)

    def coefficients(self, threads: int | None) -> np.ndarray | None:
        """(fixed, per decode row, per prefill token, per thousand context tokens, per step that prefills, per
        million attention pairs) seconds at `threads`
        (unmeasured there: the most threads measured), or None before three observations."""
        fit = self._fits.get(threads) or next((f for _, f in sorted(self._fits.items(), key=_by_threads,
                                                                      reverse=True)), None)
        return None if fit is None or fit.observations < 3 else fit.coefficients()

    def predict(self, threads: int | None, decode_rows: int, prefill_tokens: int, context: int = 0,
                drafts: int = 0, pairs: int | None = None) -> float | None:
        """Seconds of a step; `pairs` None: its `prefill_tokens` are a prompt's first (attention_pairs(0, P))."""
        c = self.coefficients(threads)
        return None if c is None else float(c @ _features(decode_rows, prefill_tokens, context, drafts, pairs))

    def prompt_room(self, threads: int | None, seconds: float, decode_rows: int, context: int) -> float:
        """Seconds of prompt work (`prompt_work`) a step of `decode_rows` rows reading `context` KV tokens has
        left within `seconds`, once it prefills at all (its prompt path paid). Measured steps only."""
        c = self.coefficients(threads)
        return seconds - float(c @ _features(decode_rows, 0, context, 0, 0)) - float(c[4])

    def prompt_work(self, threads: int | None, tokens: int, pairs: int) -> float:
        """Seconds `tokens` prompt tokens reading `pairs` attention pairs add to a step: the same however a prompt
        is chunked (a token attends to every earlier one of its prompt in any chunking). Measured steps only."""
        c = self.coefficients(threads)
        return float(c[2]) * tokens + float(c[5]) * pairs / PAIRS_UNIT

    def chunk_within(self, threads: int | None, seconds: float, decode_rows: int, context: int, start: int,
                     most: int) -> int:
        """The most prompt tokens after `start` computed ones, up to `most`, a step of `decode_rows` rows (reading
        `context`) carries within `seconds` (0: not even one; the step's cost grows with the chunk's attention
        pairs). Measured steps only: see `coefficients`."""
        c = self.coefficients(threads)
        room = self.prompt_room(threads, seconds, decode_rows, context)
        per_token, per_pair = c[2], c[5] / PAIRS_UNIT
        linear = per_token + per_pair * (start + 0.5)       # work(n) = linear n + per_pair n^2 / 2
        if room < linear + per_pair / 2:
            return 0
        if per_pair <= 0:
            return most if linear <= 0 else min(most, int(room / linear))
        return min(most, int((math.sqrt(linear * linear + 2 * per_pair * room) - linear) / per_pair))

    def overrun(self, threads: int | None) -> float:
        """How far past its prediction a step that prefills ran, the worst of the latest such steps at `threads`
        (measured / predicted over the fit's memory; at least 1, and 1 before any): the margin a step sized to a
        limit no step may pass (an ITL SLO that counts every gap) keeps: the fit predicts the mean step, so a step
        sized to the limit itself runs past it about as often as not. Every step that prefills counts, not only
        those that also decode: a prompt's chunk runs as long past its prediction on cores that lag (a shared
        VM's second vCPU) whether or not rows decode beside it, and steps alone come first and far more often."""
        return max((1.0, *self._overruns.get(threads, ())))

    def seconds_per_prefill_token(self, threads: int | None) -> float | None:
        """The per-prefill-token coefficient, or None until three observed steps carried prefill (at
        `threads`, else at the most threads measured): a coefficient no step exercised is not measured,
        whatever the fit says (routing on one such rate sent a conversation's next turn away from its prefix)."""
        c = self.coefficients(threads)
        counted = threads if threads in self._fits else max(self._fits, key=_by_threads_key, default=None)
        if c is None or c[2] <= 0 or self._prefill_steps.get(counted, 0) < 3:
            return None
        return float(c[2])


def _features(decode_rows: int, prefill_tokens: int, context: int, drafts: int, pairs: int | None) -> np.ndarray:
    pairs = attention_pairs(0, prefill_tokens) if pairs is None else pairs
    return np.array([1.0, decode_rows, prefill_tokens + drafts, context / CONTEXT_UNIT, float(prefill_tokens > 0),
                     pairs / PAIRS_UNIT])


def _by_threads(item: tuple) -> int:
    return item[0] or 0


def _by_threads_key(threads: int | None) -> int:
    return threads or 0
