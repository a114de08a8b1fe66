"""Per-row token constraints of one runner: grammar matchers (llguidance) and logit biases.

A row's matcher is built from its grammar and the output tokens the row was created with, so it
is right wherever the row is created: the prefill unit, the decode unit after the hand-off, a
re-prefill after preemption, a worker process. A step's masks are filled on a helper thread while
the forward runs (`start`), then unpacked on the logits' device and applied to them in place before
sampling (`StepConstraints.to`, `.apply`); the runner advances the matchers with the tokens it sampled
(`advance`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.text.grammar import GrammarCache, grammar_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepConstraints:
    """What one step's sampled rows may choose: a bitmask per grammar row, biases per biased row."""

    mask_rows: torch.Tensor | None      # [G] long: batch rows with a grammar; None when every row has one
    bitmask: torch.Tensor | None        # [G, ceil(V / 32)] int32 on the host: bit t of a row set when t is allowed
    bias_index: torch.Tensor | None     # [2, K] long: (batch row, token)
    bias_values: torch.Tensor | None    # [K] fp32
    mask_seconds: float                 # host time spent building matchers and filling the masks
    vocab_size: int
    disallowed: torch.Tensor | None = None  # [G, V] bool, True where a token is masked out: `to` unpacks it
    faults: tuple[tuple[int, str], ...] = ()   # (row, why): rows whose grammar could not be built (unconstrained)

    def to(self, device: torch.device) -> "StepConstraints":
        """On `device`, the bitmask unpacked there: numpy's bit unpacking on the host, torch shifts on an
        accelerator (called by the runner's thread, on its stream, copied from pinned memory: the host never
        waits; the masks are filled on the host)."""
        if device.type == "cpu":
            disallowed = None if self.bitmask is None else host_disallowed(self.bitmask, self.vocab_size)
            return dataclasses.replace(self, bitmask=None, disallowed=disallowed)
        move = lambda t: None if t is None else t.pin_memory().to(device, non_blocking=True)  # noqa: E731
        bitmask = move(self.bitmask)
        disallowed = None if bitmask is None else ~unpack_bitmask(bitmask, self.vocab_size)
        return StepConstraints(move(self.mask_rows), None, move(self.bias_index), move(self.bias_values),
                               self.mask_seconds, self.vocab_size, disallowed)

    def apply(self, logits: torch.Tensor) -> None:
        """Add the biases, then set disallowed tokens to -inf, in place; logits [B, V] fp32."""
        assert self.bitmask is None, "StepConstraints.to(device) unpacks the bitmask before apply"
        if self.bias_index is not None:
            logits.index_put_((self.bias_index[0], self.bias_index[1]), self.bias_values, accumulate=True)
        if self.disallowed is None:
            return
        if self.mask_rows is None:
            logits.masked_fill_(self.disallowed, float("-inf"))                   # every row, in place
        else:
            logits[self.mask_rows] = logits[self.mask_rows].masked_fill(self.disallowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 bitmask -> [G, vocab_size] bool (bit t % 32 of word t // 32), on the bitmask's device."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def host_disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 host bitmask -> [G, vocab_size] bool, True where the bit is clear (one numpy pass)."""
    words = (~bitmask.numpy()).astype("<i4", copy=False)      # NOTE: little-endian words: bit t is byte t // 8's
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


class RowConstraints:
    """The grammar matchers and logit biases of a runner's rows."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.eos_token_ids = tuple(sorted(t for t in eos_token_ids if t < vocab_size))
        self.words = (vocab_size + 31) // 32
        self._eos_only = np.zeros(self.words, dtype=np.int32)           # [W]: only the EOS tokens allowed
        for eos in self.eos_token_ids:
            self._eos_only[eos // 32] |= _bit(eos % 32)
        self.matchers: dict[int, LLMatcher] = {}
        self.pending: dict[int, tuple[str, tuple[int, ...]]] = {}   # rows whose matcher is not built yet
        self.biases: dict[int, tuple[tuple[int, float], ...]] = {}
        self._cache: GrammarCache | None = None
        self._executor: LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None

    def add(self, row: int, params: SamplingParams, outputs: Sequence[int]) -> None:
        self.free(row)
        if params.grammar is not None:
            self.pending[row] = (params.grammar, tuple(outputs))
        if params.logit_bias:
            self.biases[row] = params.logit_bias

    def free(self, row: int) -> None:
        self.matchers.pop(row, None)
        self.pending.pop(row, None)
        self.biases.pop(row, None)

    def start(self, rows: Sequence[int]) -> Future | None:
        """Fill the masks of the sampled `rows` on the helper thread; None when no row is constrained."""
        if not (self.matchers or self.pending or self.biases):
            return None
        if not any(r in self.matchers or r in self.pending or r in self.biases for r in rows):
            return None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._thread.submit(self.constraints, list(rows))

    def constraints(self, rows: list[int]) -> StepConstraints:
        started = time.perf_counter()
        faults = self._build_pending()
        grammar_rows = [i for i, r in enumerate(rows) if r in self.matchers]
        bitmask = self._fill(rows, grammar_rows) if grammar_rows else None
        every_row = len(grammar_rows) == len(rows)
        pairs = [(i, t, b) for i, r in enumerate(rows) for t, b in self.biases.get(r, ())]
        return StepConstraints(
            mask_rows=torch.tensor(grammar_rows, dtype=torch.long) if grammar_rows and not every_row else None,
            bitmask=bitmask,
            bias_index=torch.tensor([(i, t) for i, t, _ in pairs], dtype=torch.long).T.contiguous() if pairs else None,
            bias_values=torch.tensor([b for _, _, b in pairs], dtype=torch.float32) if pairs else None,
            mask_seconds=time.perf_counter() - started, vocab_size=self.vocab_size, faults=faults)

    def advance(self, rows: Sequence[int], tokens: Sequence[int]) -> None:
        """Feed each grammar row the token just sampled for it."""
        if not self.matchers:
            return
        for row, token in zip(rows, tokens):
            matcher = self.matchers.get(row)
            if matcher is not None and not matcher.is_stopped() and not matcher.consume_token(token):
                logger.warning("row %d: token %d breaks its grammar: %s", row, token, matcher.get_error())

    def _build_pending(self) -> tuple[tuple[int, str], ...]:
        """Matchers for the rows added since the last step; the rows whose grammar fails to build, and why."""
        if not self.pending:
            return ()
        if self._cache is None:
            tokenizer = grammar_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids)
            self._cache, self._executor = GrammarCache(tokenizer), LLExecutor()
        faults = []
        for row, (grammar, outputs) in self.pending.items():
            try:
                self.matchers[row] = self._cache.matcher(grammar, outputs)
            except Exception as e:             # NOTE: one row's grammar fails that row only
                faults.append((row, f"{type(e).__name__}: {e}"))
        self.pending.clear()
        return tuple(faults)

    def _fill(self, rows: list[int], grammar_rows: list[int]) -> torch.Tensor:
        """The bitmask [G, W] of the grammar rows (numpy on this helper thread: a torch op here would start a
        second OpenMP team beside the forward's)."""
        bitmask = np.zeros((len(grammar_rows), self.words), dtype=np.int32)
        matchers = [(self.matchers[rows[i]], g) for g, i in enumerate(grammar_rows)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, self.words * 4, len(grammar_rows))
        empty = (~bitmask.any(axis=1)).tolist()
        ended = [g for g, (matcher, _) in enumerate(matchers) if empty[g] or matcher.is_error()]
        if ended:                                           # NOTE: a broken grammar ends the output
            bitmask[ended] = self._eos_only
        return torch.from_numpy(bitmask)


def _bit(index: int) -> int:
    """Bit `index` of an int32 word as a Python int that fits it (bit 31 is the sign)."""
    return -(1 << 31) if index == 31 else 1 << index
