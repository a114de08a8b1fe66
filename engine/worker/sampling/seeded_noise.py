"""Seeded random draws: the draw for output position `i` depends only on (seed, i).

On CUDA the sampler races exponential noise: all seeded rows are drawn in one batch of integer ops
(no launch per row), the draw for (seed, position, vocabulary column) a hash of the three (murmur3's
32-bit finaliser), with 32-bit products formed from 16-bit halves so int64 never overflows. On CPU
the sampler needs one uniform per row (`pdserve.engine.worker.sampling.categorical`), hashed from the same row key.
Each device has its own stream of draws.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1

def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for 0 <= a < 2^32, in int64 without overflow."""
    return ((a & 0xFFFF) * c + ((((a >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position): seeds, positions [R] int64 -> [R] int64."""
    high = (seeds >> 32) & _M32
    return _fmix32((seeds & _M32) ^ _fmix32(high ^ _fmix32(positions & _M32)))


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row seeded with `seeds` sampling output `positions` (the CPU
    sampler's): 53 bits from two hashes of the row's key, all rows at once."""
    high = row_keys(seeds, positions)
    low = _fmix32(high ^ _GOLDEN)
    return ((high >> 5) * (1 << 26) + (low >> 6)).to(torch.float64) * 2.0 ** -53


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Noise [R, vocab_size] fp32 > 0 for rows seeded with `seeds` sampling output `positions`: the
    batched counter-based draw (any device; the CUDA sampler's)."""
    columns = _mul32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device), _GOLDEN)
    bits = _fmix32(row_keys(seeds, positions)[:, None] ^ columns[None, :]) >> 8     # [R, V], 24 bits
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))                    # in (0, 1)
    return uniform.log_().neg_()
