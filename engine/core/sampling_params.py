"""Per-request sampling parameters, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `top_k <= 0` disables top-k; `temperature == 0` is greedy. `logprobs=None`
    returns no log-probabilities, `0` the chosen token's only, `N` the chosen
    token's plus the top N. A `seed` makes sampling reproducible: the random
    draw for output position `i` depends only on `(seed, i)`, so the same seed
    gives the same tokens whichever actor samples them.

    Raises ValueError naming the field when a value is out of range.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: str | None = None               # an llguidance grammar (JSON text): the output must match it
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 300

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens")
        _check(self.temperature >= 0.0, "temperature", "must be non-negative")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
               f"must be between 0 and {self.MAX_LOGPROBS}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        _check(len(self.logit_bias) <= self.MAX_LOGIT_BIAS, "logit_bias",
               f"must hold at most {self.MAX_LOGIT_BIAS} tokens")
        _check(all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
               "logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        _check(self.grammar is None or not (self.min_tokens or self.ignore_eos), "grammar",
               "must not be combined with min_tokens or ignore_eos (the grammar decides where the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """Whether sampling needs this row's mask or bias (a grammar or logit_bias)."""
        return self.grammar is not None or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
