"""Rotary position embedding, neox style (rotate_half), from a precomputed cos/sin table."""
from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T]; cos_sin: [P, D] = [cos | sin]
    assert cos_sin.shape[1] == q.shape[-1], "rotary dim must equal head dim"
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
