"""Batched token sampling on the logits' device, following vLLM's semantics.

Order per call: min_tokens stop masking and penalties (fp32) -> greedy argmax or temperature,
top-k, top-p, min-p and a draw (an exponential race on CUDA, inverse CDF on CPU) -> raw logprobs.
Results stay on the device: `read_back_into` queues them on the step's one device-to-host copy
(`pdserve.engine.transfer.host_copy.ReadBack`) and `unpack` turns the values into tokens once it landed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.core.messages import TokenLogprob
from pdserve.engine.transfer.host_copy import ReadBack
from pdserve.engine.worker.sampling.categorical import sample_categorical
from pdserve.engine.worker.sampling.constraints import StepConstraints
from pdserve.engine.worker.sampling.penalties import apply_penalties, mask_stop_tokens
from pdserve.engine.worker.sampling.sampling_filters import min_p_filter, top_k_only, top_k_top_p
from pdserve.engine.worker.sampling.sampling_state import SamplingState
from pdserve.engine.worker.sampling.sampling_table import SamplingBatch, SamplingTable
from pdserve.engine.worker.sampling.seeded_noise import seeded_exponential, seeded_uniforms


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: torch.Tensor                          # [B] long, on the logits' device
    chosen_logprobs: torch.Tensor | None = None   # [R] fp32 for batch.logprob_rows
    top_logprobs: torch.Tensor | None = None      # [R, N] fp32, best first
    top_ids: torch.Tensor | None = None           # [R, N] long


class Sampler:
    """Picks one token per row of a logits batch, each row by its own SamplingParams."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               constraints: StepConstraints | None = None) -> SampleOutput:
        """Sample one token per row of `logits` ([B, V'], V' >= vocab_size, any float dtype).

        Columns at or beyond `vocab_size` are never chosen; `logits` is not modified. `constraints`
        (logit biases, grammar masks) apply after the penalties, before temperature and the filters.
        """
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, "one logits row per sequence"
        assert logits.shape[1] >= self.vocab_size, "logits narrower than the vocabulary"
        logits = logits[:, : self.vocab_size]  # [B, V]
        if batch.plain_greedy and constraints is None:  # fast path: every decode step of greedy requests
            return SampleOutput(logits.argmax(dim=-1))
        processed = self.processed(logits, batch)
        if constraints is not None:
            constraints.apply(processed)
        tokens = self.choose(processed, batch)  # [B]
        return _with_logprobs(logits, tokens, batch)

    def __call__(self, logits: torch.Tensor,
                 seqs: Sequence[SamplingState]) -> list[tuple[int, TokenLogprob | None]]:
        """Sample for `seqs` without a runner's row table: per row, the token and its logprobs or None."""
        if any(seq.params.constrained for seq in seqs):
            raise ValueError("grammars and logit_bias need a runner's rows (ModelRunner.execute)")
        table = SamplingTable(self.vocab_size, self.eos_token_ids, logits.device)
        for row, seq in enumerate(seqs):
            table.add(row, seq.params, seq.prompt_token_ids, seq.output_token_ids)
        batch = table.batch(np.arange(len(seqs)))
        readback = ReadBack(logits.device)
        slots = read_back_into(readback, self.sample(logits, batch))
        readback.start()
        readback.wait()
        tokens, logprobs = unpack(readback, slots, batch)
        return list(zip(tokens, logprobs or (None,) * len(tokens)))

    def choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row of processed `logits` [B, V]: greedy rows' argmax, random rows' draw (seeded rows
        from their (seed, output number) stream)."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        probs = self.probabilities(logits, batch)  # [B, V]
        if probs.device.type == "cpu":
            sampled = sample_categorical(probs, self._uniforms(batch))
        else:
            sampled = probs.div_(self._exponential_noise(probs, batch)).argmax(dim=-1)
        return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)

    def processed(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """fp32 copy [B, V] of `logits` with min_tokens masking and penalties applied."""
        processed = logits[:, : self.vocab_size].to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        mask_stop_tokens(processed, batch)
        apply_penalties(processed, batch)
        return processed

    @staticmethod
    def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution [B, V] a random row draws from: processed logits, temperature, top-k/top-p/min-p."""
        x = logits / batch.temperature.unsqueeze(1)  # [B, V]
        if batch.use_top_p:
            x = top_k_top_p(x, batch.top_k, batch.top_p)
        elif batch.max_top_k is not None:
            x = top_k_only(x, batch.top_k, batch.max_top_k)
        if batch.use_min_p:
            x = min_p_filter(x, batch.min_p)
        return x.softmax(dim=-1)

    @staticmethod
    def _uniforms(batch: SamplingBatch) -> torch.Tensor:
        """One uniform [B] float64 per row: seeded rows from (seed, position), the rest from the default generator."""
        uniforms = torch.rand(batch.num_rows, dtype=torch.float64) if batch.any_unseeded \
            else torch.zeros(batch.num_rows, dtype=torch.float64)
        if batch.seeded_rows is not None:
            uniforms[batch.seeded_rows] = seeded_uniforms(batch.seeds, batch.positions)
        return uniforms

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exponential(1) noise [B, V]: seeded rows from (seed, position), the rest from the default generator."""
        noise = torch.empty_like(probs)
        if batch.any_unseeded:
            noise.exponential_()  # default generator, all rows at once
        if batch.seeded_rows is not None:
            noise[batch.seeded_rows] = seeded_exponential(batch.seeds, batch.positions, probs.shape[1])
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # NOTE: p / 0 would be nan or inf


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Raw-logit logprobs (log_softmax before penalties and temperature, fp32) of the rows that asked."""
    if not batch.logprob_rows:
        return SampleOutput(tokens)
    rows = batch.logprob_index
    logprobs = raw[rows].float().log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, tokens[rows].unsqueeze(1)).squeeze(1)  # [R]
    top_values, top_ids = logprobs.topk(max(batch.logprob_counts), dim=-1)  # [R, N], best first
    return SampleOutput(tokens, chosen, top_values, top_ids)


def read_back_into(readback: ReadBack, output: SampleOutput) -> tuple[int, ...]:
    """Queue `output` on the step's read-back; the slots `unpack` reads."""
    parts = (output.tokens,) if output.chosen_logprobs is None else \
        (output.tokens, output.chosen_logprobs, output.top_logprobs, output.top_ids)
    return tuple(readback.add(part) for part in parts)


def unpack(readback: ReadBack, slots: tuple[int, ...], batch: SamplingBatch
           ) -> tuple[tuple[int, ...], tuple[TokenLogprob | None, ...] | None]:
    """Tokens, and logprobs where asked (None when no row asked), from a landed read-back."""
    tokens = tuple(int(t) for t in readback.values(slots[0]))
    if len(slots) == 1:
        return tokens, None
    chosen, values, ids = (readback.values(slot) for slot in slots[1:])
    width = len(values) // max(len(chosen), 1)
    logprobs: list[TokenLogprob | None] = [None] * batch.num_rows
    for i, (row, n) in enumerate(zip(batch.logprob_rows, batch.logprob_counts)):
        top = zip((int(t) for t in ids[i * width:i * width + n]), values[i * width:i * width + n])
        logprobs[row] = TokenLogprob(tokens[row], chosen[i], tuple(top))
    return tokens, tuple(logprobs)
