"""Prompt logprobs (vLLM's `prompt_logprobs`; the prompt part of a legacy completion's `echo`), in the step that
prefills the prompt: at each position of a chunk that asks (`ChunkInput.prompt_logprobs`), the log-probability
of the row's next token under that position's raw logits (log_softmax in float32 of the LM head's output,
before penalties, temperature and masks), its rank in the vocabulary and the top alternatives. Only the asking
chunks' positions go through the LM head, a slice at a time; the values join the step's one read-back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.core.messages import PromptLogprobs
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.transfer.host_copy import ReadBack, upload
from pdserve.engine.worker.rows import RowState
from pdserve.engine.worker.step import StepInput

SLICE_POSITIONS = 64      # LM-head rows per pass: a [64, V] float32 workspace (the memory profile runs one)


@dataclass(frozen=True, slots=True)
class ScoredChunks:
    """What one step scored, in the order of the asking chunks: where to read it back and how to split it."""

    chunks: tuple[int, ...]          # indices in StepInput.chunks of the chunks that asked
    counts: tuple[int, ...]          # positions each scored (those whose next token the row holds)
    tops: tuple[int, ...]            # alternatives each asked for
    targets: np.ndarray              # [M] the scored tokens, every chunk's in order
    width: int                       # alternatives computed per position (the most any chunk asked)
    slots: tuple[int, ...] = ()      # read-back slots: logprobs, ranks, top values, top ids (none when M is 0)


def score_prompts(model: CausalLM, hidden: torch.Tensor, rows: RowState, step: StepInput,
                  readback: ReadBack) -> ScoredChunks | None:
    """Score the positions of `step`'s asking chunks from the step's final hidden states `hidden` [T, H]
    (decode rows first, then the chunks in order) and queue the values on `readback`; None when none asks."""
    asking = [i for i, c in enumerate(step.chunks) if c.prompt_logprobs is not None]
    if not asking:
        return None
    ends = len(step.decode_rows) + np.cumsum([c.num_tokens for c in step.chunks])
    counts, spans, targets = [], [], []
    for i in asking:
        c = step.chunks[i]
        tokens = rows.tokens[c.row]
        count = max(0, min(c.num_tokens, len(tokens) - 1 - c.start))
        first = int(ends[i]) - c.num_tokens
        counts.append(count)
        spans.append(np.arange(first, first + count))
        targets.append(tokens[c.start + 1:c.start + 1 + count])
    tops = tuple(step.chunks[i].prompt_logprobs for i in asking)
    scored = ScoredChunks(tuple(asking), tuple(counts), tops, np.concatenate(targets).astype(np.int64),
                          min(max(tops), model.config.vocab_size))
    if not sum(counts):
        return scored
    positions = upload(np.concatenate(spans), hidden.device, np.int64)
    values = score_positions(model, hidden, positions, upload(scored.targets, hidden.device), scored.width)
    return ScoredChunks(scored.chunks, scored.counts, scored.tops, scored.targets, scored.width,
                        tuple(readback.add(v) for v in values))


def score_positions(model: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                    width: int) -> tuple[torch.Tensor, ...]:
    """(logprobs [M], ranks [M], top values [M, width], top ids [M, width]) of `targets` at `positions`."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, positions.shape[0], SLICE_POSITIONS):
        at = positions[start:start + SLICE_POSITIONS]
        logprobs = model.compute_logits(hidden[at]).log_softmax(dim=-1)             # [n, V] fp32
        own = logprobs.gather(1, targets[start:start + SLICE_POSITIONS].unsqueeze(1))   # [n, 1]
        ranks = (logprobs > own).sum(dim=-1) + 1                                    # 1: the likeliest
        top_values, top_ids = logprobs.topk(width, dim=-1)                          # [n, width], best first
        parts.append((own.squeeze(1), ranks, top_values, top_ids))
    return tuple(torch.cat(column) for column in zip(*parts))


def read_prompt_logprobs(readback: ReadBack, scored: ScoredChunks) -> tuple[tuple[int, PromptLogprobs], ...]:
    """(chunk index, its PromptLogprobs) per asking chunk, from a landed read-back."""
    if scored.slots:
        logprobs, ranks, values, ids = (readback.values(slot) for slot in scored.slots)
    else:
        logprobs = ranks = values = ids = []
    targets, width, out, start = scored.targets.tolist(), scored.width, [], 0
    for index, count, top in zip(scored.chunks, scored.counts, scored.tops):
        stop = start + count
        top = min(top, width)
        alternatives = tuple(tuple(zip(map(int, ids[p * width:p * width + top]), values[p * width:p * width + top]))
                             for p in range(start, stop))
        out.append((index, PromptLogprobs(tuple(targets[start:stop]), tuple(logprobs[start:stop]),
                                          tuple(int(r) for r in ranks[start:stop]), alternatives)))
        start = stop
    return tuple(out)
