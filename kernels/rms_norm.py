"""RMSNorm, optionally fused with the residual add (HF LlamaRMSNorm numerics)."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    # x, residual: [T, H]; weight: [H]
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, x)
