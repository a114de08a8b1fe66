"""One draw per row from a batch of categorical distributions, by inverse CDF (the CPU sampler).

The exponential race (argmax of p / q, q ~ Exp(1) per column) needs one random number and one
logarithm per vocabulary column: on CPU, for a large vocabulary, as much as a batch-1 decode step
(bench/RESULTS.md, "Measured once").
Inverse CDF needs one uniform per row and two passes over the probabilities, in blocks of columns:
the blocks' sums (fp32, summed pairwise) and their running sum (float64) pick a block, and only
that block is summed column by column (float64). The draw is the exact inverse CDF to within ~1e-7
of the row's mass. A column with probability 0 (a filtered token) is never chosen: a running sum is
flat across it, and the draw always falls strictly below the total it is searched in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256   # columns summed together at the first level


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [B, V] >= 0 (rows need not sum to 1; each has a positive entry), uniforms [B] float64 in
    [0, 1) -> [B] long: column i with probability probs[b, i] / sum(probs[b])."""
    rows, vocab = probs.shape
    padded = F.pad(probs, (0, -vocab % BLOCK)) if vocab % BLOCK else probs
    blocks = padded.view(rows, -1, BLOCK)                                        # [B, NB, BLOCK]
    block_ends = blocks.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)            # [B, NB]
    target = _below(uniforms.to(torch.float64).unsqueeze(1) * block_ends[:, -1:], block_ends[:, -1:])
    block = torch.searchsorted(block_ends, target, right=True).clamp_max_(blocks.shape[1] - 1)   # [B, 1]
    before = torch.where(block > 0, block_ends.gather(1, (block - 1).clamp_min_(0)), 0.0)
    within = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)]   # [B, BLOCK]
    within_ends = within.to(torch.float64).cumsum_(dim=-1)
    column = torch.searchsorted(within_ends, _below(target - before, within_ends[:, -1:]), right=True)
    return (block * BLOCK + column).squeeze(1).clamp_max_(vocab - 1)       # NOTE: a NaN row: in range, no more


def _below(values: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """values clamped to [0, limits): the largest float64 under each limit at most."""
    return torch.minimum(values.clamp_min_(0.0), torch.nextafter(limits, torch.zeros_like(limits)))
