"""RMSNorm, optionally fused with the residual add (HF LlamaRMSNorm numerics)."""
from __future__ import annotations

import torch

from pdserve.kernels._triton import jit, next_power_of_2, tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    # x, residual: [T, H]; weight: [H]
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, x)


@jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """RMSNorm of x [T, H] times weight [H]; with residual returns (norm(x + residual) * weight, x + residual)."""
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous() and x.stride(1) == 1
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32) and weight.device == x.device
    assert hidden <= 65536
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    residual_out = out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        residual_out = torch.empty_like(out)
    if num_tokens > 0:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            residual_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return out if residual is None else (out, residual_out)
