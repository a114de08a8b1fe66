"""Speculative decoding on the decode side, plain Python: drafts, and how many to verify per row.

Three proposers, vLLM's methods: "ngram" (prompt lookup: the continuation of the newest earlier
occurrence of the sequence's last n tokens, for the longest n in [prompt_lookup_min,
prompt_lookup_max] that occurs), "suffix" (Snowflake's suffix decoding over the request's
prompt and output and a FIFO cache of earlier requests' outputs: engine.core.suffix_proposer) and
"draft_model" (a smaller model's greedy continuation: a `DraftModel`, engine.worker.draft_model).
Whether a step drafts, and how long each row's draft is, follows the predicted cost of verifying
it and the row's recent acceptance (engine.core.spec_policy); a row that keeps missing pauses.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pdserve.engine.core.batch import Batch
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.spec_config import SpeculativeConfig
from pdserve.engine.core.spec_policy import Acceptance, DraftGate, allot
from pdserve.engine.core.suffix_proposer import SEPARATOR, SuffixCache, propose_suffix

MISSES_BEFORE_BACKOFF = 2     # verifications in a row that accepted nothing before a row pauses
MAX_BACKOFF_STEPS = 64        # longest pause; each further miss after a pause doubles it up to this


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


class DraftModel(Protocol):
    """A draft model with its own KV on the decode unit (engine.worker.draft_model.DraftModelProposer)."""

    def propose(self, rows: Seq[tuple[str, np.ndarray, int]]) -> list[tuple[int, ...]]:
        """Per (request id, its tokens so far, k): the draft model's k greedy next tokens."""

    def release(self, request_id: str) -> None:
        """Forget the request's draft KV."""

    def reset(self) -> None:
        """Forget every request's draft KV."""

    @property
    def forward_seconds(self) -> float | None:
        """Measured seconds of one draft forward in a steady step (catch-up of a token or two), or None yet."""


@dataclass(slots=True)
class RowState:
    """One sequence's draft history: its tokens as an array (SEPARATOR after them), and its acceptance."""

    tokens: np.ndarray
    length: int
    k: int
    acceptance: Acceptance = field(default_factory=Acceptance)
    misses: int = 0
    pause: int = 0                   # steps left without speculation
    backoff: int = 1

    def sync(self, seq: Sequence) -> np.ndarray:
        total = seq.num_tokens
        if total + 1 > len(self.tokens):
            grown = np.full(max(total + 1, 2 * len(self.tokens)), SEPARATOR, dtype=np.int64)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        if total > self.length:
            self.tokens[self.length:total] = seq.token_slice(self.length, total)
            self.length = total
        self.tokens[total] = SEPARATOR
        return self.tokens[:total]


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec-decode metrics: drafts (verifications), draft tokens, accepted tokens, per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def speculator_for(config: SpeculativeConfig | None, itl_slo_ms: float | None,
                   draft_model: DraftModel | None = None) -> "Speculator | None":
    """A decode-side actor's speculator (None without `config`), bounded by the user's ITL SLO where set; a
    derived SLO is known only at the engine's start, which hands it on with `Speculator.serve`.
    `draft_model`: the unit's loaded draft for method "draft_model"."""
    if config is None:
        return None
    speculator = Speculator(config, draft_model)
    speculator.serve(itl_slo_ms / 1e3 if itl_slo_ms else None)
    return speculator


class Speculator:
    """Drafts for the rows of a decode step, and per-row draft lengths from their recent acceptance."""

    def __init__(self, config: SpeculativeConfig, draft_model: DraftModel | None = None) -> None:
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"method {config.method!r} with{'out' if draft_model is None else ''} a draft model")
        self.config = config
        self.draft_model = draft_model
        if draft_model is not None:
            draft_model.reset()                     # NOTE: a restarted actor's speculator starts afresh
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self.gate = DraftGate(config.num_speculative_tokens, config.disable_by_batch_size)
        self.overall = Acceptance(decay=1.0)
        self.cache = SuffixCache(config.suffix_decoding_max_cached_requests) if config.method == "suffix" else None
        self.faulty: list[tuple[Sequence, str]] = []

    def plan(self, seqs: list[Sequence], rooms: list[int], num_rows: int, prefill_tokens: int = 0
             ) -> list[int] | None:
        """How many drafts each of `seqs` (with room for `rooms` more tokens) verifies in a step of `num_rows`
        decode rows and `prefill_tokens` prefill tokens (engine.core.spec_policy), or None: none draft."""
        budget = self.gate.budget(num_rows, prefill_tokens)
        if budget is None:
            return None
        prior = self.overall.rate(0.5)
        states = [self._state(seq) for seq in seqs]
        caps = [0 if seq.params.constrained or state.pause > 0 else max(0, min(state.k, room))
                for seq, state, room in zip(seqs, states, rooms)]
        return allot([state.acceptance.rate(prior) for state in states], caps, num_rows, budget)

    def serve(self, itl_slo: float | None) -> None:
        """The engine's ITL SLO (seconds) bounds each step's added verification time (engine.core.spec_policy)."""
        self.gate.serve(itl_slo)

    def drafts(self, seq: Sequence, room: int, allotted: int | None = None) -> tuple[int, ...]:
        """At most `room` and `allotted` (None: the row's own length) draft tokens for `seq`'s next step (its
        output so far recorded, nothing in flight); a paused row counts one step of its pause instead."""
        return self.draft_rows([seq], [room], [allotted])[0]

    def draft_rows(self, seqs: Seq[Sequence], rooms: Seq[int], allotted: Seq[int | None]) -> list[tuple[int, ...]]:
        """`drafts` for several rows at once (a draft model runs them as one batch)."""
        lengths = [self._length(seq, room, a) for seq, room, a in zip(seqs, rooms, allotted)]
        if self.draft_model is not None:
            return self._model_drafts(seqs, lengths)
        return [self._lookup(seq, k) if k > 0 else () for seq, k in zip(seqs, lengths)]

    def _lookup(self, seq: Sequence, k: int) -> tuple[int, ...]:
        """`seq`'s drafts from the prompt or the suffix cache; none, and the sequence marked faulty, if they fail."""
        try:
            return self._propose(seq, k)
        except Exception as e:                  # NOTE: one row's drafts fail that row only
            self.faulty.append((seq, f"{type(e).__name__}: {e}"))
            return ()

    def take_faulty(self) -> list[tuple[Sequence, str]]:
        """The sequences whose drafts failed since the last call, and why (their actor ends them)."""
        faulty, self.faulty = self.faulty, []
        return faulty

    def _propose(self, seq: Sequence, k: int) -> tuple[int, ...]:
        tokens, c = seq.spec.sync(seq), self.config
        if self.cache is None:
            return tuple(propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max))
        return propose_suffix(seq.spec.tokens, len(tokens), self.cache, k, c.suffix_params).tokens

    def _length(self, seq: Sequence, room: int, allotted: int | None) -> int:
        """How many drafts `seq` takes this step (0: none; a paused row counts one step of its pause)."""
        if seq.params.constrained:     # NOTE: verification applies no grammar mask or logit_bias yet
            return 0
        state = self._state(seq)
        if state.pause > 0:
            state.pause -= 1
            return 0
        return max(0, min(state.k, room, state.k if allotted is None else allotted))

    def _model_drafts(self, seqs: Seq[Sequence], lengths: Seq[int]) -> list[tuple[int, ...]]:
        rows = [(seq.request_id, seq.spec.sync(seq), k) for seq, k in zip(seqs, lengths) if k > 0]
        proposals = iter(self.draft_model.propose(rows) if rows else ())
        self.gate.draft_forward = self.draft_model.forward_seconds
        return [next(proposals) if k > 0 else () for k in lengths]

    def accept(self, seq: Sequence, blocks: BlockManager, num_accepted: int) -> None:
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
        self.overall.observe(num_drafts, num_accepted)
        state = self._state(seq)
        state.acceptance.observe(num_drafts, num_accepted)
        if num_accepted == num_drafts:                       # all kept: twice as many next time
            state.k = min(self.config.num_speculative_tokens, max(state.k, 2 * num_drafts))
        else:                                                # one past what this one kept
            state.k = num_accepted + 1
        if num_accepted:
            state.misses, state.backoff = 0, 1
            return
        state.misses += 1
        if state.misses >= MISSES_BEFORE_BACKOFF:
            state.pause, state.backoff = state.backoff, min(2 * state.backoff, MAX_BACKOFF_STEPS)

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        """A finished step, for the step cost model (its rows, and its prefill and draft tokens, as the adaptive
        actor counts them) and, without prefill chunks, for this unit's own fit of decode steps."""
        rows = len(batch.decoding)
        drafts = None if batch.chunks else batch.num_drafts
        self.gate.observe_step(rows, batch.num_tokens - rows, seconds, threads, drafts, batch.chunk_pairs)

    def retire(self, seq: Sequence) -> None:
        """`seq` left the decode side (finished or aborted): its output joins the suffix cache."""
        if self.cache is not None:
            self.cache.add(seq.output_token_ids)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Forget `seq`'s draft state, its draft KV included (it left, or was preempted)."""
        if self.draft_model is not None:
            self.draft_model.release(seq.request_id)
        seq.spec = None

    def forget_outputs(self) -> None:
        """Empty the suffix cache (benchmarks: a measured request must not find its warm-up's answer)."""
        if self.cache is not None:
            self.cache = SuffixCache(self.cache.max_requests)

    def _state(self, seq: Sequence) -> RowState:
        if seq.spec is None:
            seq.spec = RowState(np.zeros(0, dtype=np.int64), 0, self.config.num_speculative_tokens)
        return seq.spec
