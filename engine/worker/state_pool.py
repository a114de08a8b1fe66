"""The state pool: each sequence's recurrent-layer state (conv window and delta-rule matrix of every linear-attention
layer, float32), in a slot carved from the end of its unit's KV pool tensor.

Slot i is `blocks_per_slot` consecutive blocks after the KV blocks (`StateSlots`), so everything that moves blocks
moves a slot too: the hand-off copies it as one more run of blocks through every transport, a shared pool
(memfd, CUDA IPC) shares it, and the block manager gives it out and takes it back with the sequence's table.
"""
from __future__ import annotations

import logging

import torch

from pdserve.engine.core.state_slots import StateSlots
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import RecurrentStates
from pdserve.engine.model.recurrent_config import STATE_DTYPE_BYTES
from pdserve.kernels.kv_layout import KVLayout

logger = logging.getLogger(__name__)


def slot_blocks(config: ModelConfig, layout: KVLayout, dtype: torch.dtype) -> int:
    """Blocks one sequence's state takes (0: the model has no recurrent layers)."""
    return -(-config.state_bytes() // layout.block_bytes(dtype))


def carve_state_slots(config: ModelConfig, layout: KVLayout, dtype: torch.dtype, pool_blocks: int,
                      wanted: int) -> StateSlots | None:
    """State slots from the end of a pool of `pool_blocks` blocks (None for a model without recurrent layers):
    `wanted` of them, or as many as half the pool holds where that is fewer (a sequence waits for a free slot
    as it waits for blocks); ValueError when not one slot and a KV block fit."""
    per_slot = slot_blocks(config, layout, dtype)
    if not per_slot:
        return None
    count = min(wanted, max(pool_blocks // (2 * per_slot), 1))
    first = pool_blocks - count * per_slot
    if first < 1:
        raise ValueError(f"the KV pool's {pool_blocks} blocks cannot hold a recurrent state slot of {per_slot} "
                         f"blocks and a KV block: raise --kv-cache-memory")
    if count < wanted:
        logger.info("%d recurrent state slots fit in half the KV pool: at most %d sequences run at once here "
                    "(--max-num-seqs %d; raise --kv-cache-memory for more)", count, count, wanted)
    return StateSlots(count, per_slot, first)


class StatePool:
    """Views of every slot's states in the pool tensor, per recurrent layer."""

    def __init__(self, config: ModelConfig, kv_pool: torch.Tensor, slots: StateSlots) -> None:
        la, layers = config.linear_attention, config.num_recurrent_layers
        region = KVLayout.block_view(kv_pool, slots.first_block, slots.count * slots.blocks_per_slot)
        floats = region.reshape(-1).view(torch.float32).view(slots.count, -1)         # [slots, floats per slot]
        conv, recurrent = la.conv_state_floats, la.recurrent_state_floats
        assert floats.shape[1] * STATE_DTYPE_BYTES >= config.state_bytes()
        self.slots = slots
        self.conv = tuple(floats[:, j * conv:(j + 1) * conv].view(slots.count, la.conv_dim, la.conv_kernel - 1)
                          for j in range(layers))
        base = layers * conv
        self.recurrent = tuple(
            floats[:, base + j * recurrent:base + (j + 1) * recurrent].view(
                slots.count, la.num_v_heads, la.k_head_dim, la.v_head_dim) for j in range(layers))
        self._floats = floats

    def reset(self, slots: torch.Tensor) -> None:
        """Zero these slots: sequences starting their first chunk."""
        self._floats[slots] = 0.0

    def for_step(self, slots: torch.Tensor) -> RecurrentStates:
        return RecurrentStates(slots, self.conv, self.recurrent)
