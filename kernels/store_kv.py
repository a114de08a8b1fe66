"""Write new K/V rows into the block-major KV pool by slot mapping."""
from __future__ import annotations

import torch


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                 slot_mapping: torch.Tensor) -> None:
    # key, value: [T, Hkv, D]; kv_pool: [N, L, 2, bs, Hkv, D]; slot_mapping: [T]
    block_size = kv_pool.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_pool[:, layer, 0][blocks, offsets] = key[valid].to(kv_pool.dtype)
    kv_pool[:, layer, 1][blocks, offsets] = value[valid].to(kv_pool.dtype)
