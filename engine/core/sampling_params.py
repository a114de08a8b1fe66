"""Per-request sampling parameters, validated once at construction."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1       # a seed, a priority, a token id: what the runner's tables hold
FLOAT32_MAX = 3.4028234663852886e38                      # the largest temperature the sampler's float32 holds


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `top_k <= 0` disables top-k; `temperature == 0` is greedy. `logprobs=None`
    returns no log-probabilities, `0` the chosen token's only, `N` the chosen
    token's plus the top N. `prompt_logprobs` (vLLM's) likewise for each prompt token after the
    first, under the logits of the position before it, computed where the prompt is prefilled
    (its prefix then takes no prefix-cache hits). A `seed` makes sampling reproducible: the random
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: str | None = None               # an llguidance grammar (JSON text): the output must match it
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 300

    def __post_init__(self) -> None:
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX, "max_tokens",
               "must be an integer of at least 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               "must be an integer between 0 and max_tokens")
        _check(_is_float(self.temperature) and 0.0 <= self.temperature <= FLOAT32_MAX, "temperature",
               f"must be a finite number between 0 and {FLOAT32_MAX:.4g}")
        _check(_is_float(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX, "top_k", "must be -1, 0 (disabled) or positive")
        _check(_is_float(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(_is_float(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               "must be in [-2, 2]")
        _check(_is_float(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               "must be in [-2, 2]")
        _check(_is_float(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
               "must be in (0, 10]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "must be integers in [0, 2**63 - 1]")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
               "logprobs", f"must be between 0 and {self.MAX_LOGPROBS}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS),
               "prompt_logprobs", f"must be between 0 and {self.MAX_LOGPROBS}")
        _check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX), "seed",
               "must be an integer in [-2**63, 2**63 - 1] (a 64-bit seed)")
        _check(len(self.logit_bias) <= self.MAX_LOGIT_BIAS, "logit_bias",
               f"must hold at most {self.MAX_LOGIT_BIAS} tokens")
        _check(all(_is_int(t) and 0 <= t <= INT64_MAX and _is_float(b) and -100.0 <= b <= 100.0
                   for t, b in self.logit_bias),
               "logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        _check(self.grammar is None or not (self.min_tokens or self.ignore_eos), "grammar",
               "must not be combined with min_tokens or ignore_eos (the grammar decides where the output ends)")

    @classmethod
    def unchecked(cls, **fields) -> "SamplingParams":
        """Parameters checked elsewhere already (the other side of a wire), built without checking again."""
        params = object.__new__(cls)
        for name in cls.__slots__:
            object.__setattr__(params, name, fields.get(name, getattr(_DEFAULTS, name)))
        return params

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice `index` of n: its seed offset by `index`, wrapping within 64 bits."""
        if self.seed is None or not index:
            return self
        return replace(self, seed=(self.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN)

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


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_float(value) -> bool:
    """A real number that is not NaN or infinite (an int counts)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


_DEFAULTS = SamplingParams()
