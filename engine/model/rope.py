"""Rotary embedding tables, computed once on the host (default, linear and llama3 scaling)."""
from __future__ import annotations

import math

import torch

from pdserve.engine.model.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """inv_freq: [head_dim // 2] float32 (as transformers computes it), with the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


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


def cos_sin_table(head_dim: int, max_positions: int, rope: RopeConfig) -> torch.Tensor:
    """cos_sin: [max_positions, head_dim] float32; cos in the first half, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, rope)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)            # [max_positions, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
