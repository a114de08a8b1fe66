"""Rotary embedding tables, computed once on the host: default, linear, Llama 3, YaRN, LongRoPE and proportional
frequencies, as transformers computes them, over all of a head or (partial rotary) its first dimensions.

The kernels rotate neox-style over the whole head: dimension i pairs with i + head_dim / 2. A partial
rotary over the first R dimensions pairs i with i + R / 2 instead, so the model's query and key rows are
stored in `rotary_order` (the rotated pairs first in each half, the rest after them) and the table holds
cos 1, sin 0 for the rest: the same scores, since queries and keys are reordered alike.
"""
from __future__ import annotations

import math

import torch

from pdserve.engine.model.config import RopeConfig


def inverse_frequencies(rotary_dim: int, rope: RopeConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, the factor cos and sin are scaled by) for a model serving up to
    `max_positions` positions (LongRoPE takes its long factors beyond the original context)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope.theta ** exponents, rotary_dim, rope)
    if rope.rope_type == "longrope":
        return _longrope(exponents, rope, max_positions)
    if rope.rope_type == "proportional":      # the first pairs of the whole head turn, the rest stay (Gemma 4)
        inv_freq[int(rope.partial_rotary_factor * rotary_dim // 2):] = 0.0
        return inv_freq / rope.factor, 1.0
    return inv_freq, 1.0


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    scaled = 1.0 / (rope.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    factor = rope.attention_factor
    if factor is None:
        factor = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return scaled, factor


def _longrope(exponents: torch.Tensor, rope: RopeConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """Long factors when the model serves beyond its original context (as llama.cpp decides, by the context
    served), short ones otherwise; transformers switches per forward pass by the longest position."""
    original = rope.original_max_position_embeddings
    factors = rope.long_factor if max_positions > original else rope.short_factor
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** exponents)
    factor = rope.attention_factor
    if factor is None:
        factor = 1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
    return inv_freq, factor


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """The order the model stores a head's query/key dimensions in (index of each stored dimension's
    checkpoint dimension), or None when the rotary covers the whole head (no reordering)."""
    if rotary_dim == head_dim:
        return None
    half, rotary_half, rest_half = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(rotary_half), *range(rotary_dim, rotary_dim + rest_half)]
    second = [*range(rotary_half, rotary_dim), *range(rotary_dim + rest_half, head_dim)]
    assert len(first) == len(second) == half
    return torch.tensor(first + second)


def cos_sin_table(head_dim: int, max_positions: int, rope: RopeConfig) -> torch.Tensor:
    """cos_sin: [max_positions, head_dim] float32; cos in the first half, sin in the second (each over
    `rotary_order`'s dimensions: the unrotated ones cos 1, sin 0)."""
    rotary_dim = rope.rotary_dim(head_dim)
    inv_freq, factor = inverse_frequencies(rotary_dim, rope, max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)            # [max_positions, rotary_dim // 2]
    rest = (head_dim - rotary_dim) // 2
    ones, zeros = torch.ones(max_positions, rest), torch.zeros(max_positions, rest)
    return torch.cat([freqs.cos() * factor, ones, freqs.sin() * factor, zeros], dim=-1)
