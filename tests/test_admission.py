"""The one admission rule, on a real block manager."""
from __future__ import annotations

from pdserve.engine.core.admission import can_admit
from pdserve.engine.core.block_manager import BlockManager


def test_a_sequence_must_fit_in_the_free_blocks():
    blocks = BlockManager(4, 16)
    assert can_admit(blocks, "a", 64)
    assert not can_admit(blocks, "a", 65)


def test_an_empty_pool_takes_a_sequence_above_the_watermark():
    blocks = BlockManager(10, 16)
    assert can_admit(blocks, "a", 16 * 10, max_num_seqs=4, watermark=0.5)


def test_the_watermark_holds_once_the_pool_is_in_use():
    blocks = BlockManager(10, 16)
    blocks.grow("a", 16 * 4)
    assert can_admit(blocks, "b", 16 * 4, watermark=0.8)          # 8 of 10 blocks
    assert not can_admit(blocks, "b", 16 * 5, watermark=0.8)      # 9 of 10
    assert can_admit(blocks, "b", 16 * 5)                         # no watermark: it fits


def test_the_sequence_limit_counts_sequences_in_the_pool():
    blocks = BlockManager(10, 16)
    blocks.grow("a", 1)
    blocks.grow("b", 1)
    assert not can_admit(blocks, "c", 1, max_num_seqs=2)
    assert can_admit(blocks, "c", 1, max_num_seqs=3)
    assert can_admit(blocks, "c", 1)


def test_growth_of_a_held_sequence_counts_only_new_blocks():
    blocks = BlockManager(3, 16)
    blocks.grow("a", 32)
    assert can_admit(blocks, "a", 48, max_num_seqs=1)             # one more block; already counted
    assert not can_admit(blocks, "a", 49)
