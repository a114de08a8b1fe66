"""KVLayout: the one description of the pool that allocation, sizing, copies and kernels share."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.transfer.base import block_nbytes
from pdserve.engine.worker.memory import kv_block_bytes, kv_layout
from pdserve.kernels.kv_layout import KVLayout
from pdserve.kernels.store_kv import store_kv_ref
from tests.models import demo_checkpoint

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)


def test_layout_round_trips_through_a_pool():
    pool = LAYOUT.allocate(5, torch.float16, "cpu")
    assert KVLayout.of(pool) == LAYOUT
    assert pool.shape == LAYOUT.shape(5) and KVLayout.num_blocks(pool) == 5
    assert LAYOUT.block_bytes(torch.float16) * 5 == pool.numel() * pool.element_size() == 5 * block_nbytes(pool)


def test_a_run_of_blocks_is_one_contiguous_range():
    pool = LAYOUT.allocate(6, torch.float32, "cpu")
    run = KVLayout.block_view(pool, 2, 3)
    assert run.is_contiguous()
    assert run.data_ptr() - pool.data_ptr() == 2 * LAYOUT.block_bytes(torch.float32)


def test_layer_views_see_what_store_kv_wrote():
    pool = LAYOUT.allocate(4, torch.float32, "cpu")
    key, value = torch.randn(2, 3, 2, 8).unbind(0)            # [T=3, Hkv, D] each
    slots = torch.tensor([0, 5, 15])                           # block 0 slot 0, block 1 slot 1, block 3 slot 3
    store_kv_ref(key, value, pool, 1, slots)
    k_cache, v_cache = KVLayout.layer(pool, 1)
    assert k_cache.shape == (4, 4, 2, 8)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 4, slot % 4], key[t])
        assert torch.equal(v_cache[slot // 4, slot % 4], value[t])
    assert pool[:, 0].abs().sum() == 0 and pool[:, 2].abs().sum() == 0   # other layers untouched


def test_a_tensor_that_is_not_a_pool_is_refused():
    with pytest.raises(ValueError, match="not a KV pool"):
        KVLayout.of(torch.zeros(4, 3, 3, 4, 2, 8))


def test_memory_sizing_uses_the_model_layout():
    config = ModelConfig.from_dir(demo_checkpoint())
    layout = kv_layout(config, 16)
    assert layout == KVLayout(config.num_layers, 16, config.num_kv_heads, config.head_dim)
    assert kv_block_bytes(config, 16, torch.bfloat16) == layout.block_bytes(torch.bfloat16)
