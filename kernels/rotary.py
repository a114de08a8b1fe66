"""Rotary position embedding, neox style (rotate_half), from a precomputed cos/sin table."""
from __future__ import annotations

import torch

from pdserve.kernels._triton import jit, next_power_of_2, tl


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D/2]; in x's dtype, like transformers' apply_rotary_pos_emb
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_query_ref(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    assert cos_sin.shape[1] == q.shape[-1], "rotary dim must equal head dim"
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T]; cos_sin: [P, D] = [cos | sin]
    assert cos_sin.shape[1] == q.shape[-1], "rotary dim must equal head dim"
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@jit
def _rotary_kernel(x_ptr, positions_ptr, cos_sin_ptr, out_ptr,
                   stride_xt, stride_xh, stride_ot, stride_oh, stride_cs, num_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    c = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    cos = tl.load(cos_sin_ptr + position * stride_cs + c, mask=c < half, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + position * stride_cs + half + c, mask=c < half, other=0.0)[None, :]
    mask = (h < num_heads)[:, None] & (c < half)[None, :]
    first = x_ptr + token * stride_xt + h[:, None] * stride_xh + c[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + token * stride_ot + h[:, None] * stride_oh + c[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            x, positions, cos_sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos_sin.stride(0), num_heads, head_dim // 2,
            BLOCK_H=next_power_of_2(num_heads), BLOCK_HALF=next_power_of_2(head_dim // 2), num_warps=4)
    return out


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D] and k [T, Hkv, D] at positions [T]; returns new (q, k)."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.shape[2] == k.shape[2] == cos_sin.shape[1] and q.shape[2] % 2 == 0
    assert cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1
    assert positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous()
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.dtype == k.dtype
    assert q.device == k.device == positions.device == cos_sin.device
    return _rotate_triton(q, positions, cos_sin), _rotate_triton(k, positions, cos_sin)


def rotary_query_triton(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding of q [T, Hq, D] alone."""
    assert q.dim() == 3 and q.shape[0] == positions.shape[0] and q.shape[2] == cos_sin.shape[1]
    assert cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1 and positions.is_contiguous()
    return _rotate_triton(q, positions, cos_sin)
