"""SiLU-and-mul on CPU in C++ (kernels/csrc/silu_and_mul.cpp), numerics as kernels.activation's reference."""
from __future__ import annotations

import functools

import torch

from pdserve.kernels.native import INT, INT64, POINTER, SUFFIXES, bind

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _kernel(dtype: torch.dtype):
    return bind(f"pd_silu_and_mul_{SUFFIXES[str(dtype)]}", POINTER, INT64, POINTER, INT64, INT64,
                        INT)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I]."""
    rows, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1 and x.dtype in NATIVE_DTYPES and x.device.type == "cpu"
    out = torch.empty((rows, width // 2), dtype=x.dtype)
    _kernel(x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
