"""Speculative decoding on the decode side, plain Python: n-gram drafts and how many to verify per row.

A draft is the continuation of the newest earlier occurrence of the sequence's last n tokens
(prompt and output so far), for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs (vLLM's "ngram" method, prompt lookup decoding). How many drafts a row gets adapts to its
recent acceptance; a step with more rows than `disable_by_batch_size` verifies nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence

METHODS = ("ngram",)
# NOTE: a decode step reads every weight once whatever its tokens; while rows * (1 + K) stay under the
# CPU's flop/byte ridge (~32 tokens for bf16 matmuls on AVX-512 cores at ~20 GB/s) a verification
# costs about one plain step. A roofline estimate, not a measurement: `disable_by_batch_size` overrides it.
FLAT_STEP_TOKENS = 32
MISSES_BEFORE_BACKOFF = 2     # verifications in a row that accepted nothing before a row pauses
MAX_BACKOFF_STEPS = 64        # longest pause; each further miss after a pause doubles it up to this


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields that pdserve implements."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5                   # vLLM's defaults when neither bound is given
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None     # None: FLAT_STEP_TOKENS // (1 + K) rows

    @property
    def max_rows(self) -> int:
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return max(1, FLAT_STEP_TOKENS // (1 + self.num_speculative_tokens))

    @classmethod
    def from_json(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """Parse vLLM's JSON spelling; None or '' means off. Raises ValueError naming what is wrong."""
        if not text:
            return None
        fields = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unsupported field(s) {unknown}; known: {sorted(known)}")
        if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
            fields["prompt_lookup_min"] = fields["prompt_lookup_max"]
        elif "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:
            fields["prompt_lookup_max"] = fields["prompt_lookup_min"]
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method {self.method!r} is not supported (supported: {METHODS})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("--speculative-config: num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be >= 1")


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens following the newest earlier occurrence of the longest suffix n-gram of `tokens`."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)   # [L - n, n]
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


@dataclass(slots=True)
class RowState:
    """One sequence's draft history: its tokens as an array, and its acceptance so far."""

    tokens: np.ndarray
    length: int
    k: int
    misses: int = 0
    pause: int = 0                   # steps left without speculation
    backoff: int = 1

    def sync(self, seq: Sequence) -> np.ndarray:
        total = seq.num_tokens
        if total > len(self.tokens):
            grown = np.zeros(max(total, 2 * len(self.tokens)), dtype=np.int64)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        if total > self.length:
            self.tokens[self.length:total] = seq.token_slice(self.length, total)
            self.length = total
        return self.tokens[:total]


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec-decode metrics: drafts (verifications), draft tokens, accepted tokens, per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Drafts for the rows of a decode step, and per-row draft lengths from their recent acceptance."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)

    def active(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` decode rows verifies drafts at all."""
        return num_rows <= self.config.max_rows

    def drafts(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """At most `room` draft tokens for `seq`'s next step (its output so far recorded, nothing in flight)."""
        if seq.params.constrained:     # NOTE: verification applies no grammar mask or logit_bias yet
            return ()
        state = self._state(seq)
        if state.pause > 0:
            state.pause -= 1
            return ()
        k = min(state.k, room)
        if k <= 0:
            return ()
        c = self.config
        return tuple(propose_ngram(state.sync(seq), k, c.prompt_lookup_min, c.prompt_lookup_max))

    def settle(self, seq: Sequence, blocks: BlockManager, num_accepted: int) -> None:
        """`seq`'s verification is recorded: forget the rejected drafts' positions and the blocks past the kept ones."""
        self.observe(seq, len(seq.drafts), num_accepted)
        seq.num_computed_tokens -= len(seq.drafts) - num_accepted
        seq.drafts = ()
        blocks.truncate(seq.request_id, seq.num_computed_tokens + 1)
        seq.synced_blocks = min(seq.synced_blocks, len(seq.block_table))

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted the first `num_accepted`."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafts
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1
        state = self._state(seq)
        state.k = min(self.config.num_speculative_tokens, num_accepted + 1)   # one past what the last one kept
        if num_accepted:
            state.misses, state.backoff = 0, 1
            return
        state.misses += 1
        if state.misses >= MISSES_BEFORE_BACKOFF:
            state.pause, state.backoff = state.backoff, min(2 * state.backoff, MAX_BACKOFF_STEPS)

    def _state(self, seq: Sequence) -> RowState:
        if seq.spec is None:
            seq.spec = RowState(np.zeros(0, dtype=np.int64), 0, self.config.num_speculative_tokens)
        return seq.spec
