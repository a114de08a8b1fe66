"""Logits processors applied before sampling: min_tokens stop masking and repetition,
frequency and presence penalties (vLLM semantics), batched over rows."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.worker.sampling_state import SamplingState


def mask_stop_tokens(logits: torch.Tensor, seqs: Sequence[SamplingState],
                     eos_token_ids: frozenset[int]) -> None:
    """Set EOS and `stop_token_ids` to -inf in place for rows still short of `min_tokens`.

    EOS is masked even with `ignore_eos`, as vLLM does. Ids outside the vocabulary are skipped.
    """
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, seq in enumerate(seqs):
        if len(seq.output_token_ids) < seq.params.min_tokens:
            stops = [t for t in eos_token_ids.union(seq.params.stop_token_ids) if t < vocab_size]
            rows += [row] * len(stops)
            cols += stops
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)  # [2, n]
        logits[index[0], index[1]] = float("-inf")


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SamplingState]) -> None:
    """Apply repetition, frequency and presence penalties in place to the rows that have any.

    `logits`: [B, V] fp32. Repetition divides positive logits (multiplies negative ones)
    of every token seen in prompt or output; frequency subtracts `penalty * count in output`;
    presence subtracts `penalty` once for every token present in the output.
    """
    rows = [row for row, seq in enumerate(seqs) if seq.params.has_penalties]
    if not rows:
        return
    penalized = [seqs[row] for row in rows]
    device, vocab_size = logits.device, logits.shape[1]
    output_counts = token_counts([s.output_token_ids for s in penalized], vocab_size, device)  # [R, V]
    prompt_counts = token_counts([s.prompt_token_ids for s in penalized], vocab_size, device)  # [R, V]
    table = torch.tensor([(s.params.repetition_penalty, s.params.frequency_penalty,
                           s.params.presence_penalty) for s in penalized],
                         dtype=torch.float32, device=device)  # [R, 3]
    repetition, frequency, presence = table.unsqueeze(2).unbind(1)  # each [R, 1]
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    x = logits[row_index]  # [R, V]
    seen = (output_counts + prompt_counts) > 0
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x -= frequency * output_counts + presence * (output_counts > 0)
    logits[row_index] = x


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """How often each vocabulary id occurs in each row of `token_ids`: [R, vocab_size] fp32.

    Rows are padded with `vocab_size` (a scratch column dropped at the end); ids at or
    beyond `vocab_size` are ignored.
    """
    width = max(1, max(len(ids) for ids in token_ids))
    padded = [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids]
    ids = torch.tensor(padded, dtype=torch.long, device=device).clamp_(max=vocab_size)  # [R, L]
    counts = torch.zeros(len(padded), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]
