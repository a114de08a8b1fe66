"""RMSNorm (optionally fused with the residual add) on CPU in C++: kernels/csrc/rms_norm.cpp.

Same numerics as kernels.rms_norm.rms_norm_ref (HF LlamaRMSNorm), one pass over each row.
"""
from __future__ import annotations

import functools

import torch

from pdserve.kernels.native import FLOAT, INT, INT64, POINTER, SUFFIXES, bind

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _kernel(dtype: torch.dtype):
    return bind(f"pd_rms_norm_{SUFFIXES[str(dtype)]}", POINTER, INT64, POINTER, INT64, POINTER,
                        FLOAT, POINTER, POINTER, INT64, INT64, INT)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x) * weight for x [T, H]; with residual returns (norm(x + residual) * weight, x + residual)."""
    rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous() and weight.dtype == x.dtype
    assert x.dtype in NATIVE_DTYPES and x.stride(1) == 1 and x.device.type == weight.device.type == "cpu"
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1)
    out = torch.empty((rows, hidden), dtype=x.dtype)
    summed = None if residual is None else torch.empty_like(out)
    _kernel(x.dtype)(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                     0 if residual is None else residual.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                     None if summed is None else summed.data_ptr(), rows, hidden, torch.get_num_threads())
    return out if residual is None else (out, summed)
