"""Prefix caching: the block manager's cache, and whole engines with caching on against caching off."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.engine import Engine
from tests.models import demo_checkpoint, engine_config
from tests.test_engine_modes import (
    assert_pools_free,
    collect,
    prompts,
    run_engine,
    transformers_model,  # noqa: F401
    wait_idle,
)

MODES = ("disaggregated", "colocated")
BLOCK = 16


def cached_seq(name: str, tokens: tuple[int, ...], salt: str | None = None) -> Sequence:
    return Sequence(Request(name, tokens, cache_salt=salt))


def admit(blocks: BlockManager, seq: Sequence) -> list[int]:
    """Take the cached prefix and grow; register every full block (as if its prefill had run)."""
    hashes = extend_hashes(seq, seq.num_tokens, BLOCK)
    hits = blocks.match(hashes[:(seq.num_tokens - 1) // BLOCK])
    seq.block_table = blocks.grow(seq.request_id, seq.num_tokens, prefix=hits)
    blocks.register(seq.request_id, hashes)
    return hits


# --- the block manager --------------------------------------------------------------------------

def test_a_shared_prefix_is_found_and_shared_not_copied():
    blocks = BlockManager(20, BLOCK, enable_caching=True)
    first = cached_seq("a", tuple(range(50)))                  # 3 full blocks and 2 tokens
    assert admit(blocks, first) == []
    second = cached_seq("b", tuple(range(40)) + (7,) * 20)     # shares 2 full blocks
    hits = admit(blocks, second)
    assert hits == first.block_table[:2] and second.block_table[:2] == hits
    assert set(second.block_table[2:]).isdisjoint(first.block_table)
    blocks.free("a")
    assert all(blocks._ref_counts[b] == 1 for b in hits)       # still held by "b"
    blocks.check_consistency()


def test_the_last_token_is_always_recomputed():
    blocks = BlockManager(20, BLOCK, enable_caching=True)
    admit(blocks, cached_seq("a", tuple(range(32))))
    assert len(admit(blocks, cached_seq("b", tuple(range(32))))) == 1      # not 2: the last token needs logits


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    blocks = BlockManager(6, BLOCK, enable_caching=True)
    old, new = cached_seq("old", tuple(range(32))), cached_seq("new", tuple(range(100, 132)))
    admit(blocks, old)
    admit(blocks, new)
    blocks.free("old")
    blocks.free("new")
    assert blocks.num_cached == 4 and blocks.num_free == 6
    admit(blocks, cached_seq("filler", tuple(range(500, 564))))          # the 2 never used, then the 2 oldest
    assert len(blocks.match(extend_hashes(cached_seq("x", tuple(range(32))), 32, BLOCK))) == 0   # oldest evicted
    assert len(blocks.match(extend_hashes(cached_seq("y", tuple(range(100, 132))), 32, BLOCK))) == 2
    blocks.check_consistency()


def test_different_salts_never_share_a_block():
    blocks = BlockManager(20, BLOCK, enable_caching=True)
    tokens = tuple(range(64))
    admit(blocks, cached_seq("a", tokens, salt="tenant-1"))
    assert admit(blocks, cached_seq("b", tokens, salt="tenant-2")) == []
    assert len(admit(blocks, cached_seq("c", tokens, salt="tenant-1"))) == 3


def test_random_sharing_freeing_and_eviction_keep_the_pool_consistent():
    rng = random.Random(0)
    blocks = BlockManager(40, BLOCK, enable_caching=True)
    stems = [tuple(rng.randrange(50) for _ in range(48)) for _ in range(4)]
    live: dict[str, Sequence] = {}
    for i in range(400):
        if live and (rng.random() < 0.45 or blocks.num_free < 8):
            blocks.free(live.pop(rng.choice(sorted(live))).request_id)
        else:
            seq = cached_seq(f"s{i}", rng.choice(stems)[:rng.randrange(1, 48)] + (i,) * rng.randrange(1, 40))
            if blocks.blocks_needed(seq.request_id, seq.num_tokens) <= blocks.num_free:
                admit(blocks, seq)
                live[seq.request_id] = seq
        blocks.check_consistency()
    assert blocks.prefix_queries == 0                          # admit() above does not count lookups


# --- engines ------------------------------------------------------------------------------------

def shared_prefix_requests(seed: int = 0) -> list[Request]:
    """Prompts sharing no, some and all full blocks of a stem, with partial last blocks."""
    stem = prompts([96], seed)[0]
    tails = prompts([5, 17, 1, 40, 16], seed + 1)
    bodies = [stem[:k] + tail for k, tail in zip((0, 32, 48, 96, 96), tails)] + [stem, stem[:64], stem[:64]]
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=40, seed=3), dict(temperature=0.0, logprobs=2)]
    return [Request(f"q{i}", body, SamplingParams(max_tokens=12, ignore_eos=True, **kinds[i % 3]))
            for i, body in enumerate(bodies)]


async def one_by_one(engine: Engine, requests: list[Request]) -> list[tuple]:
    """Each request after the previous one finished, so later ones find the earlier ones' blocks."""
    outputs = []
    for request in requests:
        tokens, reason = await collect(engine.submit(request))
        outputs.append((tuple(tokens), reason))
    return outputs


@pytest.mark.parametrize("mode", MODES)
def test_outputs_identical_with_caching_on_and_off(mode):
    requests = shared_prefix_requests()
    results = {}
    for caching in (False, True):
        engine = Engine(engine_config(demo_checkpoint(), mode=mode, enable_prefix_caching=caching,
                                      max_prefill_tokens=32))
        results[caching] = asyncio.run(run_engine(engine, one_by_one(engine, requests)))
        hits = sum(a.prefix_cache_hits for a in engine.stats().actors)
        assert (hits > 0) == caching
        assert_pools_free(engine)
        engine.close()
    assert results[True] == results[False]


@pytest.mark.parametrize("mode", MODES)
def test_a_second_turn_reports_its_cached_tokens_and_copies_only_new_blocks(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode))
    first_prompt = prompts([70], seed=5)[0]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def conversation():
        answer, _ = await collect(engine.submit(Request("turn-1", first_prompt, greedy)))
        second = first_prompt + tuple(answer) + prompts([9], seed=6)[0]
        events = [event async for event in engine.submit(Request("turn-2", second, greedy))]
        return events

    events = asyncio.run(run_engine(engine, conversation()))
    cached = events[-1].num_cached_tokens
    stats = {a.name: a for a in engine.stats().actors}
    if mode == "colocated":
        assert cached == (70 + 20) // BLOCK * BLOCK                 # history up to the answer's last full block
    else:
        assert cached == 70 // BLOCK * BLOCK                        # the prefill pool never saw the answer
        assert stats["decode"].prefix_cache_hits == (70 + 20) // BLOCK * BLOCK   # the decode pool did
    assert all(e.num_cached_tokens == cached for e in events)
    assert_pools_free(engine)
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_shared_blocks_survive_preemption_aborts_and_eviction_under_a_tight_pool(mode):
    stem = prompts([64], seed=8)[0]
    requests = [Request(f"t{i}", stem + prompts([8 + i], seed=20 + i)[0],
                        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)) for i in range(8)]
    roomy = Engine(engine_config(demo_checkpoint(), mode=mode, max_model_len=256, enable_prefix_caching=False))
    async def all_at_once():
        return await asyncio.gather(*(collect(roomy.submit(r)) for r in requests))

    expected = asyncio.run(run_engine(roomy, all_at_once()))
    roomy.close()
    tight = Engine(engine_config(demo_checkpoint(), mode=mode, max_model_len=256, kv_cache_memory="1MiB"))

    async def with_aborts():
        streams = [tight.submit(r) for r in requests]
        extra = [tight.submit(Request(f"x{i}", stem + (i,), SamplingParams(max_tokens=30))) for i in range(4)]
        outputs = await asyncio.gather(*(collect(s) for s in streams), *(s.aclose() for s in extra))
        await wait_idle(tight)
        return outputs[:len(streams)]

    got = asyncio.run(run_engine(tight, with_aborts()))
    assert got == expected
    decode = tight.actors[-1]
    assert (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions > 0
    assert_pools_free(tight)
    tight.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_aborted_mid_prefill_leaves_only_computed_blocks_cached(mode, transformers_model):  # noqa: F811
    """A chunk that ends inside a prompt registers only the blocks it completed: with every full block of
    the prompt registered after its first chunk, the same prompt sent again read KV never computed."""
    short, long = prompts([5, 40], seed=31)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=16))

    async def abort_then_again():
        first = engine.submit(Request("short", short, greedy))
        doomed = engine.submit(Request("doomed", long, greedy))    # its first chunk: 11 tokens, beside short's 5
        await first.__anext__()                                     # that chunk has run; the next is in flight
        engine.abort("doomed")
        await collect(first)
        await collect(doomed)
        await wait_idle(engine)
        return await collect(engine.submit(Request("again", long, greedy)))

    tokens, _ = asyncio.run(run_engine(engine, abort_then_again()))
    expected = transformers_model.generate(torch.tensor([long]), max_new_tokens=8, min_new_tokens=8,
                                           do_sample=False, pad_token_id=0)[0, len(long):].tolist()
    assert tokens == expected
    assert_pools_free(engine)
    engine.close()
