"""Write new K/V rows into the block-major KV pool by slot mapping."""
from __future__ import annotations

import torch

from pdserve.kernels._triton import jit, next_power_of_2, tl
from pdserve.kernels.kv_layout import KVLayout


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                 slot_mapping: torch.Tensor) -> None:
    # key, value: [T, Hkv, D]; kv_pool: [N, L, 2, bs, Hkv, D]; slot_mapping: [T]
    block_size = KVLayout.of(kv_pool).block_size
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache, v_cache = KVLayout.layer(kv_pool, layer)
    k_cache[blocks, offsets] = key[valid].to(kv_pool.dtype)
    v_cache[blocks, offsets] = value[valid].to(kv_pool.dtype)


@jit(do_not_specialize=("layer",))
def _store_kv_kernel(key_ptr, value_ptr, pool_ptr, slot_ptr, layer,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_pb, stride_pl, stride_pkv, stride_ps, stride_ph,
                     num_kv_heads, head_dim, PAGE_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    row = (pool_ptr + (slot // PAGE_SIZE) * stride_pb + layer * stride_pl
           + (slot % PAGE_SIZE) * stride_ps + heads * stride_ph + dims)
    tl.store(row, key.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(row + stride_pkv, value.to(pool_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                    slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into kv_pool [N, L, 2, bs, Hkv, D] at slot_mapping [T] (-1 skips)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    layout = KVLayout.of(kv_pool)
    assert value.shape == key.shape and (layout.num_kv_heads, layout.head_dim) == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    assert slot_mapping.is_contiguous() and 0 <= layer < layout.num_layers
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert key.dtype == value.dtype and key.device == kv_pool.device == slot_mapping.device
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_pool, slot_mapping, layer,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *layout.strides(kv_pool), num_kv_heads, head_dim, PAGE_SIZE=layout.block_size,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim))
