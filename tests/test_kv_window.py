"""A model whose every attention layer slides with one window: the KV blocks behind the window go back to the pool
as a sequence advances, a hand-off copies only the window, and the tokens stay transformers' (every mode, worker
processes, prefix caching); the block accounting of tables that start behind the window."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.block_manager import NO_BLOCK, BlockManager, blocks_for
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from tests.hf_models import WINDOW
from tests.models import SLOS_SET, demo_checkpoint, engine_config, hf_checkpoint
from tests.test_engine_modes import assert_pools_free, collect, expected_tokens, prompts, run_engine

ARCH = "mistral-sliding"
SIZE = 16                                          # the engine's block size
WINDOW_BLOCKS = blocks_for(WINDOW, SIZE) + 1       # the blocks a window of positions can touch
HELD = WINDOW_BLOCKS + 1                           # and the next position's, taken while a step is in flight
PROMPT, NEW = 100, 8 * WINDOW                      # a prompt of three windows, decoding to eight more


def test_kv_window_is_the_one_window_of_every_attention_layer():
    assert ModelConfig.from_dir(hf_checkpoint(ARCH)).kv_window == WINDOW
    assert ModelConfig.from_dir(hf_checkpoint("gemma3")).kv_window == 0        # a full layer reads every block
    assert ModelConfig.from_dir(demo_checkpoint()).kv_window == 0


def test_blocks_behind_the_window_go_back_and_stay_cached():
    blocks = BlockManager(16, 4, enable_caching=True, kv_window=6)
    table = blocks.grow("a", 20)                              # five blocks of four
    blocks.register("a", [bytes([i]) for i in range(5)])
    assert blocks.release_behind("a", 9) == 1                 # position 9 reads 4..9: block 0 is behind
    assert table[:2] == [NO_BLOCK, table[1]] and blocks.num_used == 4
    assert blocks.release_behind("a", 9) == 0                 # nothing more behind
    assert blocks.release_behind("a", 17) == 2 and table[:3] == [NO_BLOCK] * 3
    assert blocks.match([bytes([0]), bytes([1])]) == [0, 1]   # released blocks keep their KV until handed out
    blocks.check_consistency()
    assert blocks.free("a") == 2 and blocks.num_used == 0
    blocks.check_consistency()


def test_a_table_may_start_behind_the_window():
    blocks = BlockManager(8, 4, enable_caching=True, kv_window=6)
    assert blocks.first_needed_block(20) == 3                 # position 20 reads 15..20
    assert blocks.blocks_needed("b", 21, first_block=3) == 3
    table = blocks.grow("b", 21, first_block=3)
    assert table[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in table[3:] and blocks.num_used == 3
    blocks.grow("b", 25)
    blocks.register("b", [bytes([i]) for i in range(6)])     # no hash for an entry without a block
    assert blocks.num_cached == 3
    assert blocks.free_after("b", fence=1) == 4 and blocks.num_deferred == 4
    blocks.check_consistency()
    assert blocks.release_through(1) == 4 and blocks.num_used == 0
    blocks.check_consistency()


def test_a_table_shares_only_the_cached_blocks_its_window_reads():
    blocks = BlockManager(8, 4, enable_caching=True, kv_window=6)
    blocks.grow("a", 8)
    blocks.register("a", [b"x", b"y"])
    blocks.free("a")
    hits = blocks.match([b"x", b"y"])
    assert blocks.blocks_needed("c", 21, hits, first_block=3) == 3
    table = blocks.grow("c", 21, prefix=hits, first_block=3)
    assert table[:3] == [NO_BLOCK] * 3 and blocks.num_used == 3            # behind the window: left in the cache
    assert blocks.match([b"x", b"y"]) == hits
    later = blocks.grow("d", 9, prefix=hits, first_block=1)                # the window reads the second one
    assert later[:2] == [NO_BLOCK, hits[1]] and blocks.num_used == 5
    assert blocks.release_behind("d", 14) == 1 and later[:2] == [NO_BLOCK] * 2 and blocks.num_used == 4
    blocks.check_consistency()


def build(arch: str, mode: str, **overrides) -> Engine:
    """`mode`, "/process" for worker processes; 48-token prefill steps, SLOs stated (no start-up profile)."""
    mode, _, workers = mode.partition("/")
    if workers:
        overrides["workers"] = workers
    return Engine(engine_config(hf_checkpoint(arch), mode=mode, max_prefill_tokens=48, **SLOS_SET, **overrides))


async def decode_watching(engine: Engine, request: Request, held=lambda actor: actor.blocks.num_used):
    """The request's tokens, and the most any pool `held` (its blocks) once it decoded past its prompt's window."""
    tokens, most = [], 0
    async for event in engine.submit(request):
        tokens += event.token_ids
        if len(tokens) > WINDOW:
            most = max(most, *(held(actor) for actor in engine.actors))
    return tokens, most


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "adaptive", "disaggregated/process"])
def test_decoding_far_past_the_window_holds_only_the_window_with_transformers_tokens(mode):
    engine = build(ARCH, mode)
    copied = []
    for actor in engine.coordinator.prefill:
        finished = actor._finished_blocks
        actor._finished_blocks = lambda chunk, f=finished: copied.append(f(chunk)) or copied[-1]
    prompt = prompts([PROMPT], seed=11)[0]
    request = Request("w", prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    tokens, most = asyncio.run(run_engine(engine, decode_watching(engine, request)))
    assert tokens == expected_tokens(ARCH, prompt, NEW)
    assert most <= HELD                                        # a full table would hold 23 blocks
    sent = sum(len(copy.src_blocks) for copy in copied if copy is not None)
    if mode != "colocated" and (mode != "adaptive" or engine.actors[-1].remote_prefills):
        assert 0 < sent <= WINDOW_BLOCKS < blocks_for(PROMPT, SIZE)      # only the prompt's last window
    assert_pools_free(engine)
    engine.close()


@pytest.mark.parametrize("arch", [ARCH, "gemma3"])     # gemma3: full layers beside, the sliding ones in window slots
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_cached_prefix_longer_than_the_window_gives_transformers_tokens(mode, arch):
    engine = build(arch, mode, enable_prefix_caching=True)
    prompt = prompts([PROMPT], seed=12)[0]
    params = SamplingParams(max_tokens=2 * WINDOW, temperature=0.0, ignore_eos=True)

    async def twice():
        first, _ = await collect(engine.submit(Request("a", prompt, params)))
        second, _ = await collect(engine.submit(Request("b", prompt, params)))
        return first, second, sum(actor.blocks.prefix_hits for actor in engine.actors)

    first, second, hits = asyncio.run(run_engine(engine, twice()))
    assert first == second == expected_tokens(arch, prompt, 2 * WINDOW)
    assert hits > 0
    assert_pools_free(engine)
    engine.close()
