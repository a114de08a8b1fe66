"""Block accounting: exact under random grow/free sequences, and free again after generation."""
from __future__ import annotations

import random

import pytest

from pdserve.engine.core.block_manager import BlockManager, NoFreeBlocks, blocks_for
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from tests.models import demo_checkpoint, engine_config


def test_random_grow_and_free_keeps_exact_accounting():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=97, block_size=16)
    lengths: dict[str, int] = {}
    for step in range(3000):
        seq = f"s{rng.randrange(20)}"
        if rng.random() < 0.3:
            manager.free(seq)
            lengths.pop(seq, None)
        else:
            target = lengths.get(seq, 0) + rng.randint(1, 40)
            free_before = manager.num_free
            try:
                table = manager.grow(seq, target)
            except NoFreeBlocks:
                assert manager.num_free == free_before
                continue
            lengths[seq] = target
            assert len(table) == blocks_for(target, 16)
        assert manager.num_used == sum(blocks_for(n, 16) for n in lengths.values())
        if step % 100 == 0:
            manager.check_consistency()
    for seq in list(lengths):
        manager.free(seq)
    assert manager.num_free == 97
    manager.check_consistency()


def test_free_twice_is_a_no_op_and_tables_do_not_share_blocks():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = list(manager.grow("a", 9))
    b = list(manager.grow("b", 5))
    assert not set(a) & set(b)
    assert manager.free("a") == 3
    assert manager.free("a") == 0
    assert manager.num_free == 6
    with pytest.raises(NoFreeBlocks):
        manager.grow("c", 4 * 7)
    manager.check_consistency()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_every_block_free_after_generate_calls(mode):
    llm = LLM(config=engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=24))
    try:
        for max_tokens in (1, 7, 33):
            llm.generate(["hello", "a longer prompt " * 9, [5, 6, 7]],
                         SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=max_tokens))
            for actor in llm.engine.actors:
                assert actor.blocks.num_used == 0
                actor.blocks.check_consistency()
    finally:
        llm.close()
