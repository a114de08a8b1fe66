"""Logit filters over a [B, V] batch, each row with its own knob: top-k, top-p (nucleus), min-p."""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def top_k_only(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (ties with the k-th kept); x: [B, V]."""
    largest = x.topk(max_top_k, dim=-1).values  # [B, max_top_k]
    kth = largest.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth.masked_fill_(top_k.unsqueeze(1) >= x.shape[1], _NEG_INF)  # rows without top-k
    return x.masked_fill(x < kth, _NEG_INF)


NUCLEUS_CANDIDATES = 256


def top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`top_k_top_p_sorted`'s result from the best NUCLEUS_CANDIDATES tokens instead of a full sort (on CPU).

    Exact: a row whose nucleus or top-k set is not inside the candidates, or whose top-k meets a
    tie at the candidate edge, takes the full sort. Knowing which rows do is a read of device data,
    so on a GPU (where the host must not wait for it) every row takes the full sort. x: [B, V]."""
    vocab = x.shape[1]
    k = min(vocab - 1, NUCLEUS_CANDIDATES)
    if k < 1 or x.device.type != "cpu":
        return top_k_top_p_sorted(x, top_k, top_p)
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
        out[rows] = top_k_top_p_sorted(x[rows], top_k[rows], top_p[rows])
    return out


def top_k_top_p_sorted(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then nucleus over the survivors: drop tokens whose better-ranked mass is >= top_p."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    kth = sorted_x.gather(1, (top_k - 1).unsqueeze(1))  # [B, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, _NEG_INF)
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V], 0 for the best token: always kept
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    return torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill_(drop, _NEG_INF))


def min_p_filter(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    threshold = x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [B, 1]
    return x.masked_fill(x < threshold, _NEG_INF)
