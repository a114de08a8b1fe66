"""Verifying drafts from the logits of every draft position: which drafts are kept, and one more token.

Greedy rows keep the longest prefix of drafts equal to the argmax, then take the argmax after it,
so they emit exactly what plain decoding would. Random rows use rejection sampling with a
deterministic draft (q one-hot at the draft d): d is kept with probability p(d); at the first
rejection the token is drawn from p with d removed, renormalised; after K kept drafts a bonus
token is drawn from p. Every emitted token is then distributed as plain sampling's. Position j of
a row is processed as the row's output number (recorded outputs + j), with drafts 0 .. j-1 in its
penalty history and its min_tokens mask, and seeded rows draw from (seed, output number) streams:
acceptance from the sampler's stream, the replacement token from a second one.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.core.messages import TokenLogprob
from pdserve.engine.worker.sampling.categorical import sample_categorical
from pdserve.engine.worker.sampling.sampler import Sampler
from pdserve.engine.worker.sampling.sampling_table import SamplingBatch, SamplingTable
from pdserve.engine.worker.sampling.seeded_noise import seeded_uniforms
from pdserve.engine.worker.step import VerifyInput

RESAMPLE_SALT = 0x5BD1E995      # a seeded row's replacement draws: a stream apart from its acceptance draws


def accepted_prefix(chosen: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the tokens chosen at their positions."""
    kept = 0
    while kept < len(drafts) and chosen[kept] == drafts[kept]:
        kept += 1
    return kept


def verify(sampler: Sampler, table: SamplingTable, logits: torch.Tensor,
           rows: Sequence[VerifyInput]) -> tuple[tuple[int, ...], ...]:
    """logits [N, V'] for every position of `rows` in order -> per row, its kept drafts and one more token."""
    lengths = np.array([len(v.token_ids) for v in rows])
    entries = np.repeat([v.row for v in rows], lengths)                    # [N] runner rows
    ahead = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    batch = table.batch(entries, ahead)
    logits = logits[:, :sampler.vocab_size]
    if batch.plain_greedy:
        chosen = logits.argmax(dim=-1).tolist()
        return _greedy(chosen, rows, lengths)
    x = sampler.processed(logits, _with_draft_history(batch, rows, lengths, logits.device))
    greedy_choice = x.argmax(dim=-1)                                        # [N]
    if batch.all_greedy:
        return _greedy(greedy_choice.tolist(), rows, lengths)
    probs = sampler.probabilities(x, batch)                                 # [N, V]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    drafts = torch.tensor(_next_tokens(rows), dtype=torch.long, device=probs.device)   # [N], -1: none
    p_draft = probs.gather(1, drafts.clamp_min(0).unsqueeze(1)).squeeze(1)
    accept = torch.where(batch.greedy, greedy_choice == drafts, _uniforms(batch, 0) < p_draft) & (drafts >= 0)
    accept_host = accept.tolist()
    kept = [accepted_prefix(accept_host[s:s + n - 1], [True] * (n - 1)) for s, n in zip(starts, lengths)]
    last = torch.tensor(starts + np.array(kept), dtype=torch.long, device=probs.device)    # [R] entries
    sampled = _draw_final(probs[last], drafts[last], _select(batch, last))
    final = torch.where(batch.greedy[last], greedy_choice[last], sampled)
    return tuple(tuple(v.token_ids[1:1 + k]) + (int(t),) for v, k, t in zip(rows, kept, final.tolist()))


def emitted_logprobs(logits: torch.Tensor, table: SamplingTable, rows: Sequence[VerifyInput],
                     verified: Sequence[tuple[int, ...]]) -> tuple[tuple[TokenLogprob, ...] | None, ...] | None:
    """Per row that asked for logprobs, those of each token it emitted (raw logits, as the sampler reports
    them), else None; None when no row asked."""
    counts = table.arrays["logprobs"][np.array([v.row for v in rows])]
    if (counts < 0).all():
        return None
    starts = np.concatenate([[0], np.cumsum([len(v.token_ids) for v in rows])[:-1]])
    entries = [int(s) + j for s, n, emitted in zip(starts, counts, verified) if n >= 0 for j in range(len(emitted))]
    tokens = [t for n, emitted in zip(counts, verified) if n >= 0 for t in emitted]
    raw = logits[torch.tensor(entries, device=logits.device)].float().log_softmax(dim=-1)    # [E, V]
    chosen = raw.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = (t.tolist() for t in raw.topk(int(counts.max()), dim=-1))
    out, e = [], 0
    for n, emitted in zip(counts.tolist(), verified):
        if n < 0:
            out.append(None)
            continue
        out.append(tuple(TokenLogprob(t, chosen[e + j], tuple(zip(top_ids[e + j][:n], top_values[e + j][:n])))
                         for j, t in enumerate(emitted)))
        e += len(emitted)
    return tuple(out)


def _greedy(chosen: list[int], rows: Sequence[VerifyInput], lengths: np.ndarray) -> tuple[tuple[int, ...], ...]:
    out, start = [], 0
    for v, n in zip(rows, lengths):
        picks = chosen[start:start + n]
        kept = accepted_prefix(picks, v.token_ids[1:])
        out.append(tuple(picks[:kept + 1]))
        start += n
    return tuple(out)


def _next_tokens(rows: Sequence[VerifyInput]) -> list[int]:
    """The draft each position is checked against (the next input), -1 at a row's last position."""
    return [t for v in rows for t in (*v.token_ids[1:], -1)]


def _with_draft_history(batch: SamplingBatch, rows: Sequence[VerifyInput], lengths: np.ndarray,
                        device: torch.device) -> SamplingBatch:
    """Penalty counts of position j include the row's drafts before it (batch.output_counts is a copy)."""
    if batch.penalty_rows is None:
        return batch
    penalised = np.zeros(int(lengths.sum()), dtype=bool)
    penalised[batch.penalty_rows.cpu().numpy()] = True
    slot_of = np.cumsum(penalised) - 1
    pairs, entry = [], 0
    for v in rows:
        for j in range(len(v.token_ids)):
            if penalised[entry]:
                pairs += [(slot_of[entry], t) for t in v.token_ids[1:j + 1]]
            entry += 1
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=device).T
        batch.output_counts.index_put_((index[0], index[1]), torch.ones(index.shape[1], device=device),
                                       accumulate=True)
    return batch


def _uniforms(batch: SamplingBatch, salt: int) -> torch.Tensor:
    """[N] float64 uniforms on the logits' device: seeded entries from (seed ^ salt, output number)."""
    device = batch.temperature.device
    uniforms = torch.rand(batch.num_rows, dtype=torch.float64, device=device)
    if batch.seeded_rows is not None:
        uniforms[batch.seeded_rows] = seeded_uniforms(batch.seeds ^ salt, batch.positions).to(device)
    return uniforms


def _select(batch: SamplingBatch, entries: torch.Tensor) -> torch.Tensor:
    """Uniforms for the replacement draws at `entries` (a second stream for seeded rows)."""
    return _uniforms(batch, RESAMPLE_SALT)[entries]


def _draw_final(probs: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] at each row's first unkept position, the draft there (-1 after the last) -> [R] tokens."""
    residual = probs.clone()
    rejected = drafts >= 0
    residual[rejected.nonzero().squeeze(1), drafts[rejected]] = 0.0      # p with the rejected draft removed
    empty = residual.sum(dim=-1) <= 0                                   # NOTE: p(d) = 1 is never rejected
    residual[empty] = probs[empty]
    return sample_categorical(residual, uniforms)
