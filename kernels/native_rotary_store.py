"""Rotary embedding fused with the KV store on CPU in C++ (kernels/csrc/rotary_store.cpp): rotated q
comes back, rotated k and v are written straight into the paged pool. The reference is
kernels.rotary.rotary_ref followed by kernels.store_kv.store_kv_ref.
"""
from __future__ import annotations

import functools

import torch

from pdserve.kernels.native import INT, POINTER, SUFFIXES, bind, int64_array
from pdserve.kernels.rotary import rotary_ref
from pdserve.kernels.store_kv import store_kv_ref

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def rotary_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    q, k = rotary_ref(q, k, positions, cos_sin)
    store_kv_ref(k, v, kv_pool, layer, slot_mapping)
    return q


@functools.cache
def _kernel(dtype: torch.dtype):
    return bind(f"pd_rotary_store_{SUFFIXES[str(dtype)]}", *[POINTER] * 9, INT)


def _int32(index: torch.Tensor) -> torch.Tensor:
    # NOTE: the runner's step inputs are int32 already; other callers may pass int64
    return index.to(torch.int32).contiguous()


def rotary_store_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q [T, Hq, D] and k [T, Hkv, D]; store k, v [T, Hkv, D] at slots [T]; returns rotated q.

    NOTE: like the Triton kernels, it trusts positions < cos_sin rows and slots inside the pool."""
    tokens, q_heads, head_dim = q.shape
    _, num_layers, _, block_size, num_kv_heads, pool_head_dim = kv_pool.shape
    assert k.shape == v.shape == (tokens, num_kv_heads, head_dim) and pool_head_dim == head_dim and head_dim % 2 == 0
    assert q.dtype == k.dtype == v.dtype == kv_pool.dtype and q.dtype in NATIVE_DTYPES
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and kv_pool.is_contiguous() and 0 <= layer < num_layers
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == head_dim and cos_sin.stride(1) == 1
    assert positions.shape == slot_mapping.shape == (tokens,)
    positions, slot_mapping = _int32(positions), _int32(slot_mapping)
    assert q.is_cpu and kv_pool.is_cpu and positions.is_cpu and slot_mapping.is_cpu and cos_sin.is_cpu
    out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype)
    block, layer_stride, kv, slot, head = kv_pool.stride()[:5]
    shape = int64_array(tokens, q_heads, num_kv_heads, head_dim, *q.stride()[:2], *k.stride()[:2],
                                *v.stride()[:2], cos_sin.stride(0), block_size, block, kv, slot, head)
    _kernel(q.dtype)(q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(),
                     kv_pool.data_ptr() + layer * layer_stride * kv_pool.element_size(), slot_mapping.data_ptr(),
                     out.data_ptr(), shape, torch.get_num_threads())
    return out
