"""Logits processors applied before sampling: min_tokens stop masking and repetition, frequency and
presence penalties (vLLM semantics), batched over rows from a SamplingBatch."""
from __future__ import annotations

import torch

from pdserve.engine.worker.sampling.sampling_table import SamplingBatch


def mask_stop_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Set EOS and `stop_token_ids` to -inf in place for rows still short of `min_tokens`.

    EOS is masked even with `ignore_eos`, as vLLM does. Ids outside the vocabulary are skipped.
    """
    if batch.stop_mask is not None:
        logits[batch.stop_mask[0], batch.stop_mask[1]] = float("-inf")


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Apply repetition, frequency and presence penalties in place to the rows that have any.

    `logits`: [B, V] fp32. Repetition divides positive logits (multiplies negative ones) of every
    token seen in prompt or output; frequency subtracts `penalty * count in output`; presence
    subtracts `penalty` once for every token present in the output.
    """
    if batch.penalty_rows is None:
        return
    counts = batch.output_counts                                     # [P, V]
    repetition, frequency, presence = batch.penalties.unsqueeze(2).unbind(1)   # each [P, 1]
    x = logits[batch.penalty_rows]                                   # [P, V]
    seen = batch.prompt_seen | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x -= frequency * counts + presence * (counts > 0)
    logits[batch.penalty_rows] = x
