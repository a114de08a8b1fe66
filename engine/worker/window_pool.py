"""The window slots of a `split_window` model on its runner: carved from the end of the pool tensor (so every
transport copies a slot as a run of blocks), the map from a block to its slot, and each step's tables into them."""
from __future__ import annotations

import torch

from pdserve.engine.core.window_slots import WindowSlots
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch, WindowKV
from pdserve.kernels.kv_layout import KVLayout


def window_layout(config: ModelConfig, block_size: int) -> KVLayout:
    """A window slot's layout: the sliding layers' K and V (their own head size and KV heads) for one block."""
    return KVLayout(config.num_kv_layers - config.num_full_layers, block_size, *config.kv_shape(sliding=True))


def slot_blocks(config: ModelConfig) -> int:
    """Pool blocks (of the full layers) one window slot (the sliding layers) takes: the fewest that hold them and
    a whole number of sliding layers (so a slot run views as sliding layers, when their shapes differ)."""
    block = KVLayout(config.num_full_layers, 1, *config.kv_shape(sliding=False)).block_elements
    window = window_layout(config, 1)
    layer = window.block_elements // window.num_layers
    blocks = -(-window.block_elements // block)
    while blocks * block % layer:
        blocks += 1
    return blocks


def wanted_slots(config: ModelConfig, block_size: int, max_seqs: int, blocks_per_seq: int) -> int:
    """Slots for `max_seqs` sequences' windows and one whole sequence of `blocks_per_seq` blocks (a prompt takes its
    blocks' slots at admission and lets them go as its chunks pass)."""
    return blocks_per_seq + max_seqs * (-(-config.split_window // block_size) + 2)


def carve_window_slots(config: ModelConfig, block_size: int, pool_blocks: int, max_seqs: int,
                       blocks_per_seq: int) -> WindowSlots:
    """`wanted_slots`, taken from the end of a pool of `pool_blocks` blocks, at most as many as the blocks left
    before them (then every block can hold one); ValueError when not one slot and one block fit."""
    window, per_slot = config.split_window, slot_blocks(config)
    count = min(wanted_slots(config, block_size, max_seqs, blocks_per_seq), pool_blocks // (per_slot + 1))
    if count < 1:
        raise ValueError(f"the KV pool's {pool_blocks} blocks cannot hold a block and a window slot of {per_slot} "
                         f"blocks: raise --kv-cache-memory")
    return WindowSlots(count, per_slot, pool_blocks - count * per_slot, window)


class WindowPool:
    """Every slot's sliding-layer K and V (a pool tensor of its own, a view of the end of the runner's), and which
    block holds which slot, as the runner heard it."""

    def __init__(self, kv_pool: torch.Tensor, slots: WindowSlots, layout: KVLayout) -> None:
        """`layout`: a slot's (window_layout)."""
        region = KVLayout.block_view(kv_pool, slots.first_block, slots.count * slots.blocks_per_slot)
        self.pool = region.reshape(slots.count, -1, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.block_size = layout.block_size
        self.slot_of = torch.zeros(slots.first_block, dtype=torch.int32, device=kv_pool.device)

    def assign(self, pairs: tuple[tuple[int, int], ...]) -> None:
        if pairs:
            blocks, slots = zip(*pairs)
            index = torch.tensor(blocks, dtype=torch.int64).to(self.slot_of.device)
            self.slot_of[index] = torch.tensor(slots, dtype=torch.int32).to(self.slot_of.device)

    def for_step(self, batch: ForwardBatch) -> WindowKV:
        """The step's block tables and store slots in the window pool (entries behind a window are never read)."""
        tables = self.slot_of[batch.block_tables.long()]
        stores = batch.slot_mapping
        blocks = self.slot_of[torch.div(stores, self.block_size, rounding_mode="floor").clamp_min(0)].long()
        slots = torch.where(stores >= 0, blocks * self.block_size + stores % self.block_size, stores)
        return WindowKV(self.pool, tables, slots)
