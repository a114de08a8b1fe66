"""A model mixing one sliding window with full-attention layers (Gemma 2/3, gpt-oss): the pool's blocks hold the full
layers' K and V, and only the blocks inside a sequence's window hold a window slot for the sliding layers'. The slot
accounting of tables, the prefix cache and deferred frees; transformers' tokens in every mode with the slots held to
the window; a hand-off that copies no slot outside the window; aborts; the context cap (a cached prefix past the
window: test_kv_window.py; what a 5:1 model holds: bench/window_memory.py)."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.block_manager import BlockManager, NoFreeBlocks, blocks_for
from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.window_slots import NO_SLOT, WindowSlots
from pdserve.engine.units.layout import split_windows
from tests.hf_models import WINDOW
from tests.models import engine_config, hf_checkpoint
from tests.test_kv_window import build, decode_watching
from tests.test_engine_modes import assert_pools_free, collect, expected_tokens, prompts, random_aborts, run_engine

SIZE = 16                                          # the engine's block size
WINDOW_BLOCKS = blocks_for(WINDOW, SIZE) + 1       # the blocks a window of positions can touch
HELD = WINDOW_BLOCKS + 1                           # and the next position's, taken while a step is in flight
PROMPT, NEW = 100, 8 * WINDOW


def manager(num_blocks: int = 12, slots: int = 6, caching: bool = True) -> BlockManager:
    """Blocks of 4 tokens, a window of 6 tokens (a position reads at most two blocks)."""
    return BlockManager(num_blocks, 4, caching, window_slots=WindowSlots(slots, 2, num_blocks, 6))


def slots_held(actor) -> int:
    return actor.blocks.windows.pool.num_held


def slotted(blocks: BlockManager, seq_id: str) -> list[bool]:
    pool = blocks.windows.pool
    return [pool.slot_of[block] != NO_SLOT for block in blocks.table(seq_id)]


def test_split_window_is_the_sliding_window_of_a_model_with_full_layers_too():
    assert ModelConfig.from_dir(hf_checkpoint("gemma3")).split_window == WINDOW
    assert ModelConfig.from_dir(hf_checkpoint("gemma2")).split_window == WINDOW
    assert ModelConfig.from_dir(hf_checkpoint("mistral-sliding")).split_window == 0   # every layer slides
    config = ModelConfig.from_dir(hf_checkpoint("gemma3"))                            # sliding, sliding, full
    assert [config.pool_layer(i, split=True) for i in range(3)] == [0, 1, 0]
    assert [config.pool_layer(i, split=False) for i in range(3)] == [0, 1, 2]


def test_blocks_inside_the_window_hold_slots_and_let_them_go_as_it_passes():
    blocks = manager()
    blocks.grow("a", 12)                                   # a prompt: every block takes its slot at admission
    assert slotted(blocks, "a") == [True] * 3 and blocks.windows.pool.num_held == 3
    assert len(blocks.take_window_assignments()) == 3 and not blocks.take_window_assignments()
    assert blocks.release_behind("a", 12) == 1             # position 12 reads positions 7..12: blocks 1 and 2
    assert slotted(blocks, "a") == [False, True, True]
    blocks.grow("a", 20)
    assert blocks.release_behind("a", 19) == 2
    assert slotted(blocks, "a") == [False, False, False, True, True] and blocks.num_used == 5
    blocks.check_consistency()
    blocks.free("a")
    assert blocks.windows.pool.num_held == 0 and blocks.num_used == 0
    blocks.check_consistency()


def test_a_new_table_needs_window_slots_only_from_where_it_computes():
    blocks = manager(slots=3)
    assert blocks.num_free == 3                            # a block inside a window needs a slot too
    assert blocks.lacks_window_slots("a", 24)              # a prompt of six blocks takes six slots
    assert not blocks.lacks_window_slots("a", 24, window_from=23)
    table = blocks.grow("a", 24, window_from=23)           # copied KV: the decode side computes from 23 on
    assert slotted(blocks, "a") == [False] * 4 + [True] * 2
    assert blocks.window_blocks("a")[:4] == ((),) * 4 and len(blocks.window_blocks("a")[5]) == 2
    with pytest.raises(NoFreeBlocks, match="window slots"):
        blocks.grow("b", 12)
    assert len(table) == 6
    blocks.check_consistency()


def test_a_cached_prefix_is_usable_while_its_last_window_keeps_its_slots():
    blocks = manager(slots=4)
    blocks.grow("a", 16)
    blocks.register("a", [b"w", b"x", b"y", b"z"])
    blocks.release_behind("a", 16)                         # blocks 0 and 1 passed: cached, their slots kept
    blocks.free("a")
    assert blocks.windows.pool.num_held == 0 and blocks.windows.pool.available == 4
    prompt = [b"w", b"x", b"y", b"z"]
    assert len(blocks.match(prompt)) == 4
    blocks.grow("b", 8)                                    # takes the least recently kept slots: blocks 0 and 1's
    assert len(blocks.match(prompt)) == 4                  # the last window (blocks 2 and 3) still has its slots
    blocks.grow("c", 8)                                    # then blocks 2 and 3's
    assert blocks.match(prompt) == []                      # no prefix ends at a window that kept its slots
    blocks.check_consistency()


def test_a_freed_table_with_a_step_in_flight_keeps_its_slots_until_the_fence():
    blocks = manager()
    blocks.grow("a", 8)
    blocks.free_after("a", fence=3)
    assert blocks.windows.pool.num_held == 2
    blocks.check_consistency()
    blocks.release_through(3)
    assert blocks.windows.pool.num_held == 0 and blocks.num_used == 0
    blocks.check_consistency()


def test_rejected_drafts_let_their_slots_go():
    blocks = manager()
    blocks.grow("a", 4)
    blocks.grow("a", 12)                                   # room for drafts
    blocks.truncate("a", 5)
    assert slotted(blocks, "a") == [True, True] and blocks.windows.pool.num_held == 2
    blocks.check_consistency()


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss", "gemma4"])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "adaptive", "disaggregated/process"])
def test_decoding_far_past_the_window_holds_slots_for_the_window_only_with_transformers_tokens(mode, arch):
    engine = build(arch, mode)
    assert all(actor.blocks.windows for actor in engine.actors)
    copied = []
    for actor in engine.coordinator.prefill:
        finished = actor._finished_blocks
        actor._finished_blocks = lambda chunk, f=finished, a=actor: copied.append((a, f(chunk))) or copied[-1][1]
    prompt = prompts([PROMPT], seed=11)[0]
    request = Request("w", prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    tokens, most = asyncio.run(run_engine(engine, decode_watching(engine, request, slots_held)))
    assert tokens == expected_tokens(arch, prompt, NEW)
    assert most <= HELD                                        # every block's slot would be 23
    slots_sent = sum(sum(block >= actor.blocks.num_blocks for block in copy.src_blocks)
                     for actor, copy in copied if copy is not None)
    per_slot = engine.actors[0].blocks.windows.pool.slots.blocks_per_slot
    if mode != "colocated" and (mode != "adaptive" or engine.actors[-1].remote_prefills):
        assert 0 < slots_sent <= WINDOW_BLOCKS * per_slot      # only the prompt's last window's slots
    assert_pools_free(engine)
    engine.close()


def test_with_kv_tiers_every_block_holds_every_layer():
    """A tier record is a whole block: with tiers on, the sliding layers' K and V stay in the blocks."""
    config = engine_config(hf_checkpoint("gemma3"))
    model = ModelConfig.from_dir(hf_checkpoint("gemma3"))
    assert split_windows(config, model)
    assert not split_windows(replace(config, cache=replace(config.cache, kv_offload_memory="16MiB")), model)
    assert not split_windows(config, ModelConfig.from_dir(hf_checkpoint("mistral-sliding")))


def test_the_context_is_capped_where_a_prompt_finds_a_window_slot_for_each_block():
    """A prompt takes a window slot for each of its blocks at admission: where a small pool has fewer slots than
    blocks, the longest context is what the slots hold (a longer prompt would wait for slots forever)."""
    config = ModelConfig.from_dir(hf_checkpoint("gemma3"))
    block_bytes = config.num_full_layers * 2 * SIZE * config.num_kv_heads * config.head_dim * 4
    engine = build("gemma3", "colocated", kv_cache_memory=61 * block_bytes)        # 20 slots of 2, 21 blocks
    blocks = engine.actors[0].blocks
    assert (blocks.windows.pool.slots.count, blocks.num_blocks) == (20, 21)
    assert engine.max_model_len == 20 * SIZE
    prompt = prompts([20 * SIZE - 8], seed=13)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def once():
        return await collect(engine.submit(Request("long", prompt, params)))

    tokens, _ = asyncio.run(run_engine(engine, once()))
    assert tokens == expected_tokens("gemma3", prompt, 8)
    assert_pools_free(engine)
    engine.close()


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])      # gemma4: two layer shapes, layers reading others' KV
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "adaptive"])
def test_random_aborts_at_every_stage_leave_every_block_and_window_slot_free(mode, overlap, arch):
    engine = build(arch, mode, enable_prefix_caching=True, async_scheduling=overlap)
    results = asyncio.run(run_engine(engine, random_aborts(engine, random.Random(7), seed=5, max_tokens=40)))
    assert_pools_free(engine)
    assert sum(reason is FinishReason.ABORT for _, reason in results) >= 12
    assert all(len(tokens) == 40 for tokens, reason in results if reason is FinishReason.LENGTH)
    engine.close()
