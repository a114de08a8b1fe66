"""The state pool: each sequence's recurrent-layer state (conv window and delta-rule matrix of every linear-attention
layer, float32), in a slot carved from the end of its unit's KV pool tensor.

Slot i is `blocks_per_slot` consecutive blocks after the KV blocks (`StateSlots`), so everything that moves blocks
moves a slot too: the hand-off copies it as one more run of blocks through every transport, a shared pool
(memfd, CUDA IPC) shares it, and the block manager gives it out and takes it back with the sequence's table.
"""
from __future__ import annotations

import torch

from pdserve.engine.core.block_manager import StateSlots
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import RecurrentStates
from pdserve.engine.model.recurrent_config import STATE_DTYPE_BYTES
from pdserve.kernels.kv_layout import KVLayout


def slot_blocks(config: ModelConfig, layout: KVLayout, dtype: torch.dtype) -> int:
    """Blocks one sequence's state takes (0: the model has no recurrent layers)."""
    return -(-config.state_bytes() // layout.block_bytes(dtype))


def carve_state_slots(config: ModelConfig, layout: KVLayout, dtype: torch.dtype, pool_blocks: int,
                      count: int) -> StateSlots | None:
    """`count` state slots from the end of a pool of `pool_blocks` blocks (None for a model without recurrent
    layers); ValueError when no KV block would be left."""
    per_slot = slot_blocks(config, layout, dtype)
    if not per_slot:
        return None
    first = pool_blocks - count * per_slot
    if first < 1:
        raise ValueError(f"the KV pool's {pool_blocks} blocks cannot hold {count} recurrent state slots of "
                         f"{per_slot} blocks each (--max-num-seqs) and a KV block: raise --kv-cache-memory")
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
