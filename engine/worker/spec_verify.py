"""Verifying drafts from the logits of every draft position: which drafts are kept, and one more token.

Greedy rows keep the longest prefix of drafts equal to the argmax, then take the argmax after it,
so they emit exactly what plain decoding would. Random rows draw each position's token as plain
sampling draws it (the sampler's `choose`, a seeded row from its (seed, output number) stream) and keep
the drafts while they equal those draws, then the draw after them. With a deterministic draft d this is
rejection sampling: d is kept with probability p(d), and at the first rejection the token is distributed
as p with d removed, renormalised; so every emitted token is distributed as plain sampling's, and a seeded
row emits exactly the tokens it would without speculation, whatever drafts it was given. Position j of a
row is processed as the row's output number (recorded outputs + j), with drafts 0 .. j-1 in its penalty
history and its min_tokens mask.

Everything runs on the logits' device without reading anything back (`verify_on_device`); the kept
counts, the tokens and the logprobs come back with the step's one read-back (`read_verified`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.core.messages import TokenLogprob
from pdserve.engine.transfer.host_copy import ReadBack, upload
from pdserve.engine.worker.sampling.sampler import Sampler
from pdserve.engine.worker.sampling.sampling_table import SamplingBatch, SamplingTable
from pdserve.engine.worker.step import VerifyInput


@dataclass(frozen=True, slots=True)
class Verified:
    """Per verifying row, on the device: drafts kept, and every token it emits."""

    kept: torch.Tensor              # [R] long
    emitted: torch.Tensor           # [R, L] long: the kept drafts, the token after them, then padding
    logprobs: tuple | None = None   # (chosen [E], top values [E, N], top ids [E, N]) for `logprob_entries`
    logprob_rows: tuple[int, ...] = ()      # verifying rows (indices into the step's verify) that asked
    logprob_counts: tuple[int, ...] = ()    # their number of top alternatives


def verify(sampler: Sampler, table: SamplingTable, logits: torch.Tensor,
           rows: Sequence[VerifyInput]) -> tuple[tuple[int, ...], ...]:
    """logits [N, V'] for every position of `rows` in order -> per row, its kept drafts and one more token."""
    readback = ReadBack(logits.device)
    slots = read_back_into(readback, verify_on_device(sampler, table, logits, rows))
    readback.start()
    readback.wait()
    return read_verified(readback, slots, rows)[0]


def verify_on_device(sampler: Sampler, table: SamplingTable, logits: torch.Tensor,
                     rows: Sequence[VerifyInput]) -> Verified:
    """The verification of `rows`, left on the device (see the module docstring)."""
    lengths = np.array([len(v.token_ids) for v in rows])
    entries = np.repeat([v.row for v in rows], lengths)                    # [N] runner rows
    ahead = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    batch = table.batch(entries, ahead)
    logits = logits[:, :sampler.vocab_size]
    device = logits.device
    drafts = upload(np.array(_next_tokens(rows), dtype=np.int64), device)          # [N], -1: none
    if batch.plain_greedy:
        return _kept_and_emitted(logits.argmax(dim=-1), drafts, rows, lengths)
    x = sampler.processed(logits, _with_draft_history(batch, rows, lengths, device))
    return _kept_and_emitted(sampler.choose(x, batch), drafts, rows, lengths)


def with_logprobs(verified: Verified, logits: torch.Tensor, table: SamplingTable,
                  rows: Sequence[VerifyInput]) -> Verified:
    """`verified` with the raw-logit logprobs (as the sampler reports them) of every position of the rows
    that asked; `read_verified` keeps those of the tokens each row emitted."""
    counts = table.arrays["logprobs"][np.array([v.row for v in rows])]
    asking = np.flatnonzero(counts >= 0)
    if not len(asking):
        return verified
    lengths = np.array([len(v.token_ids) for v in rows])
    starts, width = _starts(lengths), verified.emitted.shape[1]
    entries = np.concatenate([starts[r] + np.arange(lengths[r]) for r in asking])
    positions = np.concatenate([r * width + np.arange(lengths[r]) for r in asking])
    device = logits.device
    raw = logits[upload(entries, device, np.int64)].float().log_softmax(dim=-1)      # [E, V]
    tokens = verified.emitted.flatten()[upload(positions, device, np.int64)]
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_values, top_ids = raw.topk(int(counts.max()), dim=-1)
    return Verified(verified.kept, verified.emitted, (chosen, top_values, top_ids), tuple(asking.tolist()),
                    tuple(counts[asking].tolist()))


def read_back_into(readback: ReadBack, verified: Verified) -> tuple[int, ...]:
    parts = (verified.kept, verified.emitted, *(verified.logprobs or ()))
    return tuple(readback.add(part) for part in parts)


def read_verified(readback: ReadBack, slots: tuple[int, ...], rows: Sequence[VerifyInput], verified_logprobs=()
                  ) -> tuple[tuple[tuple[int, ...], ...], tuple | None]:
    """(per row its kept drafts and one more token, per row its emitted tokens' logprobs or None) from a
    landed read-back; `verified_logprobs`: the `Verified.logprob_rows` and `.logprob_counts` of the step."""
    kept = [int(k) for k in readback.values(slots[0])]
    emitted = readback.values(slots[1])
    width = len(emitted) // max(len(rows), 1)
    tokens = tuple(tuple(int(t) for t in emitted[r * width:r * width + k + 1]) for r, k in enumerate(kept))
    if len(slots) == 2:
        return tokens, None
    asking, counts = verified_logprobs
    chosen, values, ids = (readback.values(slot) for slot in slots[2:])
    top = len(values) // max(len(chosen), 1)
    out: list[tuple[TokenLogprob, ...] | None] = [None] * len(rows)
    e = 0
    for r, n in zip(asking, counts):
        out[r] = tuple(TokenLogprob(t, chosen[e + j], tuple(zip((int(i) for i in ids[(e + j) * top:(e + j) * top + n]),
                                                                 values[(e + j) * top:(e + j) * top + n])))
                       for j, t in enumerate(tokens[r]))
        e += len(rows[r].token_ids)
    return tokens, tuple(out)


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def _kept(accept: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
    """accept [N] bool per position -> [R] long: how many leading drafts of each row were accepted."""
    width = int(lengths.max()) - 1
    if width <= 0:
        return torch.zeros(len(lengths), dtype=torch.long, device=accept.device)
    columns = np.arange(width)
    index = np.where(columns < (lengths - 1)[:, None], _starts(lengths)[:, None] + columns, len(accept))   # [R, W]
    padded = torch.cat([accept, accept.new_zeros(1)])[upload(index, accept.device, np.int64)]
    return padded.long().cumprod(dim=1).sum(dim=1)


def _kept_and_emitted(choice: torch.Tensor, drafts: torch.Tensor, rows: Sequence[VerifyInput],
                      lengths: np.ndarray) -> Verified:
    """Drafts kept while they equal each position's chosen token (argmax or draw), then the token after them."""
    kept = _kept(choice == drafts, lengths)
    final = choice[upload(_starts(lengths), choice.device) + kept]
    return Verified(kept, _emitted(rows, lengths, kept, final))


def _emitted(rows: Sequence[VerifyInput], lengths: np.ndarray, kept: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[R, L] long: each row's drafts with the final token written at its kept count."""
    padded = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for r, v in enumerate(rows):
        padded[r, :len(v.token_ids) - 1] = v.token_ids[1:]
    emitted = upload(padded, final.device)
    return emitted.scatter_(1, kept.unsqueeze(1), final.long().unsqueeze(1))


def _next_tokens(rows: Sequence[VerifyInput]) -> list[int]:
    """The draft each position is checked against (the next input), -1 at a row's last position."""
    return [t for v in rows for t in (*v.token_ids[1:], -1)]


def _with_draft_history(batch: SamplingBatch, rows: Sequence[VerifyInput], lengths: np.ndarray,
                        device: torch.device) -> SamplingBatch:
    """Penalty counts of position j include the row's drafts before it (batch.output_counts is a copy)."""
    if batch.penalty_rows is None:
        return batch
    penalised = np.zeros(int(lengths.sum()), dtype=bool)
    penalised[batch.penalty_entries] = True
    slot_of = np.cumsum(penalised) - 1
    pairs, entry = [], 0
    for v in rows:
        for j in range(len(v.token_ids)):
            if penalised[entry]:
                pairs += [(slot_of[entry], t) for t in v.token_ids[1:j + 1]]
            entry += 1
    if pairs:
        index = upload(np.array(pairs, dtype=np.int64).T, device)
        batch.output_counts.index_put_((index[0], index[1]), torch.ones(index.shape[1], device=device),
                                       accumulate=True)
    return batch
