"""KV tiers in whole engines: multi-turn chats whose KV is several times the pool, with tiers and without.

Later turns must find their history in the tiers (counted) and every greedy answer must be the one computed
without them, in the default (adaptive) mode, with two decode units, disaggregated, and with worker
processes; aborts, preemption and a killed worker must leave the pools and the tiers consistent.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from tests.models import SLOS_SET, demo_checkpoint, engine_config
from tests.test_engine_modes import assert_pools_free, collect, prompts, run_engine, wait_idle
from tests.test_supervisor import until

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONVERSATIONS, TURNS = 8, 3


def tiered(config, tmp_path, memory: int | None = 96 << 10, disk: int | None = 4 << 20):
    """`config` with a host tier of `memory` bytes and a disk tier of `disk` bytes in `tmp_path` (None: none)."""
    cache = dataclasses.replace(config.cache, kv_offload_memory=memory,
                                kv_offload_disk=None if disk is None else (str(tmp_path), disk))
    return dataclasses.replace(config, cache=cache)


def chat_config(**overrides):
    """A pool of about 16 blocks per unit that decodes: one conversation's history is up to 10 of them."""
    values = dict(kv_cache_memory="640KiB", max_model_len=240, max_prefill_tokens=64, **SLOS_SET) | overrides
    return engine_config(demo_checkpoint(), **values)


async def chats(engine: Engine, record: list | None = None) -> list[tuple[int, ...]]:
    """CONVERSATIONS conversations of TURNS turns, each with its own 96-token opening; within a turn they run
    two at a time, so each evicts the blocks of the ones before it. A turn that ends in an error (a unit
    failed under it) is sent again once the engine is healthy."""
    histories = [prompts([96], seed=40 + i)[0] for i in range(CONVERSATIONS)]
    answers = []
    for turn in range(TURNS):
        for pair in range(0, CONVERSATIONS, 2):
            results = await asyncio.gather(*(answer(engine, f"c{i}-t{turn}", histories[i]) for i in (pair, pair + 1)))
            for i, (tokens, cached) in zip((pair, pair + 1), results):
                answers.append(tuple(tokens))
                histories[i] = histories[i] + tuple(tokens) + prompts([16], seed=100 * turn + i)[0]
                if record is not None:
                    record.append((turn, cached))
    return answers


async def answer(engine: Engine, name: str, prompt: tuple[int, ...]) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of `prompt`, sent again while it ends in an error."""
    for attempt in range(3):
        tokens, cached, reason = [], 0, None
        async for event in engine.submit(Request(f"{name}-{attempt}", prompt, GREEDY)):
            tokens += event.token_ids
            cached, reason = event.num_cached_tokens, event.finish_reason
        if reason != FinishReason.ERROR:
            return tokens, cached
        await until(engine.healthy)
    raise AssertionError(f"{name} failed three times")


def tier_hits(engine: Engine) -> int:
    return sum(tier.hit_tokens for tier in engine.stats().tiers)


def assert_consistent(engine: Engine) -> None:
    assert_pools_free(engine)
    store = engine.units.tiers.index
    store.check_consistency()
    for tier in store.tiers:
        assert tier.num_pinned == tier.num_pending == 0, tier.name
        assert len(tier) <= tier.num_slots


@pytest.fixture(scope="module")
def without_tiers() -> dict:
    """The answers without tiers, by layout (computed once)."""
    return {}


def answers_without(cache: dict, **overrides) -> list[tuple[int, ...]]:
    key = tuple(sorted(overrides.items()))
    if key not in cache:
        engine = Engine(chat_config(**overrides))
        cache[key] = asyncio.run(run_engine(engine, chats(engine)))
        engine.close()
    return cache[key]


@pytest.mark.parametrize("layout", [
    dict(),                                                   # the default mode: adaptive
    dict(decode_device="cpu,cpu"),                            # two decode units
    dict(mode="disaggregated"),
    dict(mode="colocated", workers="process"),
], ids=["adaptive", "two-decode-units", "disaggregated", "worker-processes"])
def test_later_turns_load_their_history_from_the_tiers_with_the_same_answers(tmp_path, without_tiers, layout):
    expected = answers_without(without_tiers, **layout)
    engine = Engine(tiered(chat_config(**layout), tmp_path))
    turns: list = []
    got = asyncio.run(run_engine(engine, chats(engine, turns)))
    assert got == expected
    assert tier_hits(engine) > 0
    assert any(cached > 0 for turn, cached in turns if turn > 0)
    stats = engine.stats().tiers
    assert stats[0].evictions > 0                             # the host tier is smaller than the chats' KV
    assert all(tier.bad_blocks == 0 for tier in stats)
    assert_consistent(engine)
    engine.close()


def test_a_disk_tier_alone_serves_later_turns_too(tmp_path, without_tiers):
    expected = answers_without(without_tiers, mode="colocated")
    engine = Engine(tiered(chat_config(mode="colocated"), tmp_path, memory=None))
    assert asyncio.run(run_engine(engine, chats(engine))) == expected
    (disk,) = engine.stats().tiers
    assert disk.name == "disk" and disk.hit_tokens > 0 and disk.bytes_out > 0
    assert_consistent(engine)
    engine.close()


def test_damaged_disk_records_are_recomputed_and_counted(tmp_path, without_tiers):
    """Every block on disk gets flipped bytes before it is read back: the answers stay those without tiers."""
    expected = answers_without(without_tiers, mode="colocated")
    engine = Engine(tiered(chat_config(mode="colocated"), tmp_path, memory=None))
    disk = engine.units.tiers.tiers[0]
    write = disk.write

    def damaged(slot, digest, data, crc, written_ns):
        write(slot, digest, data, crc ^ 1, written_ns)         # as if a byte of the block had flipped on disk
    disk.write = damaged
    assert asyncio.run(run_engine(engine, chats(engine))) == expected
    (stats,) = engine.stats().tiers
    assert stats.bad_blocks > 0 and stats.hit_tokens == 0
    assert_consistent(engine)
    engine.close()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_aborts_and_preemption_under_a_tight_pool_leave_pools_and_tiers_consistent(tmp_path, mode):
    requests = [Request(f"t{i}", prompts([72 + 3 * i], seed=20 + i)[0],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(8)]
    fillers = [Request(f"f{i}", prompts([150], seed=60 + i)[0], GREEDY) for i in range(4)]
    roomy = Engine(engine_config(demo_checkpoint(), mode=mode, max_model_len=256, **SLOS_SET))

    async def all_at_once(engine, batch, suffix=""):
        return await asyncio.gather(*(collect(engine.submit(dataclasses.replace(r, request_id=r.request_id + suffix)))
                                      for r in batch))

    expected = asyncio.run(run_engine(roomy, all_at_once(roomy, requests)))
    roomy.close()
    tight = Engine(tiered(engine_config(demo_checkpoint(), mode=mode, max_model_len=256, kv_cache_memory="1MiB",
                                        **SLOS_SET), tmp_path, memory=48 << 10))

    async def with_aborts():
        first = await all_at_once(tight, requests)
        await all_at_once(tight, fillers)                     # evicts what the first round left in the pools
        streams = [tight.submit(dataclasses.replace(r, request_id=r.request_id + "b")) for r in requests]
        extra = [tight.submit(Request(f"x{i}", prompts([90], seed=i)[0], SamplingParams(max_tokens=30)))
                 for i in range(4)]
        outputs = await asyncio.gather(*(collect(s) for s in streams), *(s.aclose() for s in extra))
        await wait_idle(tight)
        return first, outputs[:len(streams)]

    first, second = asyncio.run(run_engine(tight, with_aborts()))
    assert first == expected and second == expected
    decode = tight.actors[-1]
    assert (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions > 0
    assert tier_hits(tight) > 0
    assert_consistent(tight)
    tight.close()


def killed_when(unit, copies: str) -> dict:
    """SIGKILL `unit`'s worker right after it is sent its first step that carries tier `copies` (saves, loads)."""
    submit, state = unit.submit, {"killed": False}

    def submit_then_kill(work):
        future = submit(work)
        if not state["killed"] and getattr(work, f"tier_{copies}"):
            state["killed"] = True
            os.kill(unit.pid, signal.SIGKILL)
        return future
    unit.submit = submit_then_kill
    return state


@pytest.mark.parametrize("copies", ["saves", "loads"])
def test_a_worker_killed_mid_tier_copies_leaves_the_tiers_consistent_and_the_answers_right(tmp_path, without_tiers,
                                                                                          copies):
    expected = answers_without(without_tiers, mode="colocated")
    engine = Engine(tiered(chat_config(mode="colocated", workers="process"), tmp_path))
    killed = killed_when(engine.units.computes[0], copies)
    assert asyncio.run(run_engine(engine, chats(engine))) == expected
    assert killed["killed"] and engine.stats().restarts == 1
    assert tier_hits(engine) > 0
    assert_consistent(engine)
    engine.close()
