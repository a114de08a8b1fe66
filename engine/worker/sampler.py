"""Batched token sampling on the logits' device, following vLLM's semantics.

Order per call: min_tokens stop masking and penalties (fp32) -> greedy argmax or
temperature, top-k, top-p, min-p and an exponential race -> raw logprobs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.messages import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.worker.penalties import apply_penalties, mask_stop_tokens
from engine.worker.sampling_state import SamplingState

_SEED_MULTIPLIER = 1_000_003
_SEED_MODULUS = 2**63
_NEG_INF = float("-inf")


def generation_seed(seed: int, position: int) -> int:
    """Seed of the generator that draws output position `position` of a request seeded with `seed`."""
    return (seed * _SEED_MULTIPLIER + position) % _SEED_MODULUS


class Sampler:
    """Picks one token per row of a logits batch, each row by its own SamplingParams."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor,
                 seqs: Sequence[SamplingState]) -> list[tuple[int, TokenLogprob | None]]:
        """Sample one token per row of `logits` ([B, V'], V' >= vocab_size, any float dtype).

        Returns, per row, the token id and, when `params.logprobs` is not None, its raw
        logprob with the top `params.logprobs` alternatives. Columns at or beyond
        `vocab_size` are never chosen. `logits` is not modified.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), "one logits row per sequence"
        assert logits.shape[1] >= self.vocab_size, "logits narrower than the vocabulary"
        logits = logits[:, : self.vocab_size]  # [B, V]
        if all(_plain_greedy(seq) for seq in seqs):  # fast path: every decode step
            return [(token, None) for token in logits.argmax(dim=-1).tolist()]
        processed = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        mask_stop_tokens(processed, seqs, self.eos_token_ids)
        apply_penalties(processed, seqs)
        tokens = self._choose(processed, seqs)  # [B]
        return _with_logprobs(logits, tokens, seqs)

    def _choose(self, logits: torch.Tensor, seqs: Sequence[SamplingState]) -> torch.Tensor:
        if all(seq.params.greedy for seq in seqs):
            return logits.argmax(dim=-1)
        knobs = _Knobs.build(seqs, self.vocab_size, logits.device)
        sampled = self._sample(logits, knobs, seqs)
        if knobs.any_greedy:
            return torch.where(knobs.greedy, logits.argmax(dim=-1), sampled)
        return sampled

    def _sample(self, logits: torch.Tensor, knobs: _Knobs,
                seqs: Sequence[SamplingState]) -> torch.Tensor:
        x = logits / knobs.temperature.unsqueeze(1)  # [B, V]
        if knobs.use_top_p:
            x = _top_k_top_p(x, knobs.top_k, knobs.top_p)
        elif knobs.max_top_k is not None:
            x = _top_k(x, knobs.top_k, knobs.max_top_k)
        if knobs.use_min_p:
            x = _min_p(x, knobs.min_p)
        probs = x.softmax(dim=-1)  # [B, V]
        return probs.div_(self._exponential_noise(probs, seqs)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, seqs: Sequence[SamplingState]) -> torch.Tensor:
        """Exponential(1) noise [B, V]: seeded rows from a generator seeded by (seed, position)."""
        seeded = [(row, generation_seed(seq.params.seed, len(seq.output_token_ids)))
                  for row, seq in enumerate(seqs)
                  if seq.params.seed is not None and not seq.params.greedy]
        noise = torch.empty_like(probs)
        if len(seeded) < len(seqs):
            noise.exponential_()  # default generator, all rows at once
        generator = self._generator(probs.device)
        for row, seed in seeded:
            noise[row].exponential_(generator=generator.manual_seed(seed))
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # NOTE: p / 0 would be nan or inf

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


@dataclass(frozen=True, slots=True)
class _Knobs:
    """Per-row sampling parameters as tensors on the logits' device; greedy rows are neutral."""

    greedy: torch.Tensor       # [B] bool
    temperature: torch.Tensor  # [B] fp32, 1 for greedy rows
    top_k: torch.Tensor        # [B] long, vocab_size when disabled
    top_p: torch.Tensor        # [B] fp32
    min_p: torch.Tensor        # [B] fp32
    any_greedy: bool
    max_top_k: int | None      # None: no row uses top-k
    use_top_p: bool
    use_min_p: bool

    @staticmethod
    def build(seqs: Sequence[SamplingState], vocab_size: int, device: torch.device) -> _Knobs:
        rows = [_row_knobs(seq.params, vocab_size) for seq in seqs]
        table = torch.tensor(rows, dtype=torch.float32, device=device)  # [B, 5]
        greedy, temperature, top_k, top_p, min_p = table.unbind(1)
        top_ks = [int(row[2]) for row in rows if row[2] < vocab_size]
        return _Knobs(greedy=greedy.bool(), temperature=temperature, top_k=top_k.long(),
                      top_p=top_p, min_p=min_p, any_greedy=any(row[0] for row in rows),
                      max_top_k=max(top_ks) if top_ks else None,
                      use_top_p=any(row[3] < 1.0 for row in rows),
                      use_min_p=any(row[4] > 0.0 for row in rows))


def _row_knobs(params: SamplingParams, vocab_size: int) -> tuple[float, float, float, float, float]:
    """(greedy, temperature, top_k, top_p, min_p) for one row."""
    if params.greedy:
        return (1.0, 1.0, float(vocab_size), 1.0, 0.0)
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    return (0.0, params.temperature, float(top_k), params.top_p, params.min_p)


def _top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (ties with the k-th kept); x: [B, V]."""
    largest = x.topk(max_top_k, dim=-1).values  # [B, max_top_k]
    kth = largest.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth.masked_fill_(top_k.unsqueeze(1) >= x.shape[1], _NEG_INF)  # rows without top-k
    return x.masked_fill(x < kth, _NEG_INF)


NUCLEUS_CANDIDATES = 256


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_top_k_top_p_sorted`'s result from the best NUCLEUS_CANDIDATES tokens instead of a full sort.

    Exact: a row whose nucleus or top-k set is not inside the candidates, or whose top-k meets a
    tie at the candidate edge, takes the full sort. x: [B, V]."""
    vocab = x.shape[1]
    k = min(vocab - 1, NUCLEUS_CANDIDATES)
    if k < 1:
        return _top_k_top_p_sorted(x, top_k, top_p)
    vals, idx = x.topk(k + 1, dim=-1)  # [B, k + 1], best first; the last one only checks for ties
    edge_tie = vals[:, k] == vals[:, k - 1]
    vals, idx = vals[:, :k], idx[:, :k]
    has_top_k = top_k < vocab
    kth = vals.gather(1, (top_k.clamp(max=k) - 1).unsqueeze(1)).masked_fill_(~has_top_k.unsqueeze(1), _NEG_INF)
    vals = vals.masked_fill(vals < kth, _NEG_INF)
    normalizer = torch.where(has_top_k.unsqueeze(1), vals.logsumexp(-1, keepdim=True),
                             x.logsumexp(-1, keepdim=True))
    probs = (vals - normalizer).exp()  # [B, k], the row's own distribution
    cumulative = probs.cumsum(dim=-1)
    drop = ((cumulative - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    truncated = torch.full_like(x, _NEG_INF).scatter_(1, idx, vals.masked_fill(drop, _NEG_INF))
    restricted = (has_top_k | (top_p < 1.0)).unsqueeze(1)
    out = torch.where(restricted, truncated, x)
    top_k_outside = has_top_k & (edge_tie | (top_k > k))
    nucleus_outside = (top_p < 1.0) & ~has_top_k & (cumulative[:, -1] < top_p)
    uncovered = top_k_outside | nucleus_outside
    if bool(uncovered.any()):
        rows = uncovered.nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(x[rows], top_k[rows], top_p[rows])
    return out


def _top_k_top_p_sorted(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then nucleus over the survivors: drop tokens whose better-ranked mass is >= top_p."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    kth = sorted_x.gather(1, (top_k - 1).unsqueeze(1))  # [B, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, _NEG_INF)
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V], 0 for the best token: always kept
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    return torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill_(drop, _NEG_INF))


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    threshold = x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [B, 1]
    return x.masked_fill(x < threshold, _NEG_INF)


def _plain_greedy(seq: SamplingState) -> bool:
    params = seq.params
    return (params.temperature == 0.0 and params.logprobs is None and not params.has_penalties
            and len(seq.output_token_ids) >= params.min_tokens)


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                   seqs: Sequence[SamplingState]) -> list[tuple[int, TokenLogprob | None]]:
    """Attach raw-logit logprobs (log_softmax before penalties and temperature, fp32)."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return [(token, None) for token in tokens.tolist()]
    row_index = torch.tensor(rows, dtype=torch.long, device=raw.device)
    logprobs = raw[row_index].float().log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, tokens[row_index].unsqueeze(1)).squeeze(1)  # [R]
    num_top = max(seqs[row].params.logprobs for row in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [R, num_top], best first
    token_list, chosen_list = tokens.tolist(), chosen.tolist()
    top_value_list, top_id_list = top_values.tolist(), top_ids.tolist()
    results: list[tuple[int, TokenLogprob | None]] = [(token, None) for token in token_list]
    for i, row in enumerate(rows):
        n = seqs[row].params.logprobs
        top = tuple(zip(top_id_list[i][:n], top_value_list[i][:n]))
        results[row] = (token_list[row], TokenLogprob(token_list[row], chosen_list[i], top))
    return results
