"""The gated MLP activations: silu(x[:, :I]) * x[:, I:] (Llama) and gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's GeGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels._triton import jit, tl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] -> [T, I], in x's dtype like transformers' LlamaMLP
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] -> [T, I], like transformers' GemmaMLP with gelu_pytorch_tanh
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, intermediate, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, intermediate, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)     # sqrt(2 / pi) (g + 0.044715 g^3)
    t = tl.exp(-2.0 * tl.abs(inner))                                         # tanh from exp
    tanh = tl.where(inner >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t)
    tl.store(out_ptr + row * stride_o + cols, (0.5 * gate * (1.0 + tanh) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I]."""
    return _gated_triton(x, gelu_tanh=False)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I]."""
    return _gated_triton(x, gelu_tanh=True)


def _gated_triton(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    num_tokens, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = 1024
        kernel = _gelu_tanh_and_mul_kernel if gelu_tanh else _silu_and_mul_kernel
        kernel[(num_tokens, -(-intermediate // block))](
            x, out, x.stride(0), out.stride(0), intermediate, BLOCK=block, num_warps=4)
    return out
