"""Disaggregated and colocated modes against each other and transformers; aborts, preemption, ordering."""
from __future__ import annotations

import asyncio
import functools
import random
import threading
import time

import pytest
import torch
import transformers

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.config import ModelConfig
from tests.hf_models import reference_model as hf_reference
from tests.hf_models import HYBRID_ARCHS, MOE_ARCHS, transformers_greedy
from tests.models import SLOS_SET, demo_checkpoint, engine_config, hf_checkpoint

MODES = ("disaggregated", "colocated")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def held_steps(unit) -> tuple[threading.Event, threading.Event]:
    """Make each of `unit`'s steps wait for `release` (at most 30 s) once it has set `started`."""
    started, release = threading.Event(), threading.Event()
    run = unit.step_runner.run

    def held(work):
        started.set()
        release.wait(30.0)                              # NOTE: a bound on the hold, not on the outcome
        return run(work)
    unit.step_runner.run = held
    return started, release


def prompts(lengths, seed=0, vocab=1024):
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, vocab, (n,), generator=generator).tolist()) for n in lengths]


async def run_engine(engine: Engine, coro):
    await engine.start()
    try:
        return await coro
    finally:
        await engine.stop()


async def collect(stream) -> tuple[list[int], FinishReason]:
    tokens, reason = [], None
    async for event in stream:
        tokens += event.token_ids
        reason = event.finish_reason
    return tokens, reason


async def staggered(engine: Engine, requests: list[Request]) -> list[list[int]]:
    """Submit half the requests, wait for the first one's first token, then submit the rest."""
    half = len(requests) // 2
    streams = [engine.submit(r) for r in requests[:half]]
    first = await streams[0].__anext__()
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    tasks += [asyncio.ensure_future(collect(engine.submit(r))) for r in requests[half:]]
    results = await asyncio.gather(*tasks)
    results[0] = (list(first.token_ids) + results[0][0], results[0][1])
    return [tokens for tokens, _ in results]


async def wait_idle(engine: Engine) -> None:
    """Until no actor holds a block or a sequence (bounded by the test timeout)."""
    while any(a.kv_blocks_used or a.running or a.waiting for a in engine.stats().actors):
        await asyncio.sleep(0.005)


def assert_pools_free(engine: Engine) -> None:
    for actor in engine.actors:
        assert actor.blocks.num_used == 0, actor.name
        assert not actor.blocks.windows or actor.blocks.windows.pool.num_held == 0, actor.name
        actor.blocks.check_consistency()


@pytest.fixture(scope="module")
def transformers_model():
    return transformers.AutoModelForCausalLM.from_pretrained(demo_checkpoint(), dtype=torch.float32).eval()


def test_greedy_identical_in_both_modes_and_transformers(transformers_model):
    batch = prompts([5, 70, 33, 140, 9, 64])
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(batch)]
    outputs = {}
    for mode in MODES:
        engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32))
        outputs[mode] = asyncio.run(run_engine(engine, staggered(engine, requests)))
        assert_pools_free(engine)
        engine.close()
    assert outputs["disaggregated"] == outputs["colocated"]
    for prompt, tokens in zip(batch, outputs["colocated"]):
        expected = transformers_model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                               do_sample=False, pad_token_id=0)[0, len(prompt):]
        assert tokens == expected.tolist()


def test_seeded_sampling_identical_in_both_modes():
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    requests = [Request(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts([12, 50, 3], seed=2), params))]
    outputs = {}
    for mode in MODES:
        engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=16))
        outputs[mode] = asyncio.run(run_engine(engine, staggered(engine, requests)))
        engine.close()
    assert outputs["disaggregated"] == outputs["colocated"]
    assert len({tuple(t) for t in outputs["colocated"]}) == 3


@pytest.mark.parametrize("mode", MODES)
def test_random_aborts_at_every_stage_free_every_block(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32))
    results = asyncio.run(run_engine(engine, random_aborts(engine, random.Random(0), seed=3, max_tokens=30)))
    assert_pools_free(engine)
    assert all(reason in (FinishReason.ABORT, FinishReason.LENGTH) for _, reason in results)
    assert sum(reason is FinishReason.ABORT for _, reason in results) >= 12
    assert all(len(tokens) == 30 for tokens, reason in results if reason is FinishReason.LENGTH)
    engine.close()


async def random_aborts(engine: Engine, rng: random.Random, seed: int, max_tokens: int) -> list:
    """24 prompts of 1-200 tokens, one aborted while queued, each other after 0-12 events; (tokens, reason) each."""
    streams = [engine.submit(Request(f"a{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
               for i, p in enumerate(prompts([rng.randint(1, 200) for _ in range(24)], seed=seed))]
    engine.abort("a0")                                       # queued
    results = await asyncio.gather(*(abort_after(engine, s, rng.randint(0, 12)) for s in streams))
    await wait_idle(engine)
    return results


async def abort_after(engine: Engine, stream, events: int):
    tokens, reason, seen = [], None, 0
    async for event in stream:
        tokens += event.token_ids
        reason = event.finish_reason
        seen += 1
        if seen == events and reason is None:
            engine.abort(stream.request_id)
    if events == 0 and reason is None:
        engine.abort(stream.request_id)
    return tokens, reason


@pytest.mark.parametrize("mode", MODES)
def test_small_decode_pool_preempts_and_every_request_completes(mode):
    requests = [Request(f"p{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts([40] * 8, seed=4))]
    roomy = Engine(engine_config(demo_checkpoint(), mode=mode, max_model_len=256))
    expected = asyncio.run(run_engine(roomy, staggered(roomy, requests)))
    roomy.close()
    tight = Engine(engine_config(demo_checkpoint(), mode=mode, max_model_len=256, kv_cache_memory="1MiB"))
    got = asyncio.run(run_engine(tight, staggered(tight, requests)))
    assert got == expected
    assert all(len(tokens) == 100 for tokens in got)
    decode = tight.actors[-1]
    assert (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions > 0
    assert_pools_free(tight)
    tight.close()


@functools.cache
def expected_tokens(arch: str, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    model = hf_reference(hf_checkpoint(arch))
    return transformers_greedy(model, prompt, new_tokens)


@pytest.mark.parametrize("arch", ["mistral-sliding", "gemma2", "gemma3", "gemma4", "phi3", "smollm3", *MOE_ARCHS,
                                  *HYBRID_ARCHS])
@pytest.mark.parametrize("mode", MODES + ("adaptive",))
def test_every_family_preempts_and_resumes_with_transformers_tokens(mode, arch):
    """Sequences grow past their sliding windows in a pool too small for all of them: some are preempted,
    prefilled again (prompt and tokens so far) and finish with transformers' tokens. A model with recurrent
    layers gets a state slot for each of the eight sequences besides (its state starts again from zero). Where
    every layer slides, a sequence holds only its window's blocks: sixteen shorter prompts, in pools that hold a
    whole sequence (a preempted one is prefilled again whole) but not sixteen windows."""
    config = ModelConfig.from_dir(hf_checkpoint(arch))
    token_bytes = config.kv_elements_per_token() * 4
    count, length, pool_tokens = (16, 20, 560) if config.kv_window else (8, 40, 1024)
    requests = [Request(f"p{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts([length] * count, seed=4))]
    states = dict(max_num_seqs=8) if arch in HYBRID_ARCHS else {}
    memory = pool_tokens * token_bytes + 8 * config.state_bytes()
    tight = Engine(engine_config(hf_checkpoint(arch), mode=mode, max_model_len=256, kv_cache_memory=memory, **states))
    got = asyncio.run(run_engine(tight, staggered(tight, requests)))
    assert got == [expected_tokens(arch, r.prompt_token_ids, 100) for r in requests]
    decode = tight.actors[-1]
    assert (decode.decode if mode == "colocated" else decode.scheduler).num_preemptions > 0
    assert_pools_free(tight)
    tight.close()


@pytest.mark.parametrize("mode", MODES)
def test_short_prompt_gets_first_token_before_long_prompt_finishes_prefill(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=64))
    long_prompt, short_prompt = prompts([1500, 8], seed=5)
    first_token_order = []

    async def first_token(stream):
        async for event in stream:
            first_token_order.append(stream.request_id)
            await stream.aclose()
            return

    async def scenario():
        long_stream = engine.submit(Request("long", long_prompt, GREEDY))
        short_stream = engine.submit(Request("short", short_prompt, GREEDY))
        await asyncio.gather(first_token(long_stream), first_token(short_stream))
        await wait_idle(engine)

    asyncio.run(run_engine(engine, scenario()))
    assert first_token_order == ["short", "long"]
    assert_pools_free(engine)
    engine.close()


def test_event_loop_keeps_ticking_during_a_long_prefill():
    engine = Engine(engine_config(demo_checkpoint(), mode="disaggregated", max_prefill_tokens=2048, **SLOS_SET))
    prefill_runner = engine.actors[0].runner
    step_windows = []
    original_execute = prefill_runner.execute

    def timed_execute(batch):
        start = time.monotonic()
        try:
            return original_execute(batch)
        finally:
            step_windows.append((start, time.monotonic()))

    prefill_runner.execute = timed_execute
    beats = []

    async def heartbeat(stop: asyncio.Event):
        while not stop.is_set():
            beats.append(time.monotonic())
            await asyncio.sleep(0)

    async def scenario():
        stop = asyncio.Event()
        ticker = asyncio.ensure_future(heartbeat(stop))
        await collect(engine.submit(Request("long", prompts([2000], seed=6)[0],
                                            SamplingParams(max_tokens=2, ignore_eos=True))))
        stop.set()
        await ticker

    asyncio.run(run_engine(engine, scenario()))
    engine.close()
    start, end = max(step_windows, key=lambda w: w[1] - w[0])
    beats_during_prefill = sum(start < b < end for b in beats)
    assert beats_during_prefill >= 10


def test_health_reports_an_actor_stuck_in_one_step():
    engine = Engine(engine_config(demo_checkpoint(), mode="disaggregated", **SLOS_SET))
    decode, release = engine.actors[1], threading.Event()
    real_execute = decode.runner.execute

    def stuck(step):
        release.wait(60)
        return real_execute(step)

    decode.runner.execute = stuck

    async def scenario():
        assert engine.healthy()
        stream = engine.submit(Request("r", prompts([8])[0], GREEDY))
        await stream.__anext__()                      # the prefill actor's token; decode's first step hangs
        while decode.step_started_at is None:
            await asyncio.sleep(0.005)
        decode._in_flight[0].started -= 10.0          # as if that step had hung for 10 s
        assert engine.healthy(stall_seconds=60.0)
        assert not engine.healthy(stall_seconds=5.0)
        release.set()
        await collect(stream)
        await engine.actors[0].stop()
        assert not engine.healthy()

    asyncio.run(run_engine(engine, scenario()))
    assert not engine.healthy()
    engine.close()


class SlowHandle:
    """A copy that reports done only after a few polls (a copy still in flight on a device)."""

    def __init__(self, inner, polls: int) -> None:
        self.inner, self.polls, self.nbytes = inner, polls, inner.nbytes

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0 and self.inner.done()

    def wait(self) -> None:
        self.polls = -1
        self.inner.wait()

    @property
    def seconds(self):
        return self.inner.seconds


class SlowTransfer:
    name = "slow"

    def __init__(self, inner, polls: int) -> None:
        self.inner, self.polls = inner, polls

    def copy_blocks(self, *args):
        return SlowHandle(self.inner.copy_blocks(*args), self.polls)


def test_copies_in_flight_delay_admission_and_aborts_during_them_free_both_pools():
    batch = prompts([30, 90, 7, 150, 64, 12], seed=8)
    greedy = [Request(f"g{i}", p, GREEDY) for i, p in enumerate(batch)]
    reference = Engine(engine_config(demo_checkpoint(), mode="disaggregated", max_prefill_tokens=32))
    expected = asyncio.run(run_engine(reference, staggered(reference, greedy)))
    reference.close()

    engine = Engine(engine_config(demo_checkpoint(), mode="disaggregated", max_prefill_tokens=32))
    copier = engine.actors[0].unit.step_runner
    copier.peers = tuple(peer._replace(transfer=SlowTransfer(peer.transfer, polls=3)) for peer in copier.peers)
    assert asyncio.run(run_engine(engine, staggered(engine, greedy))) == expected
    assert_pools_free(engine)

    async def abort_while_landing():
        streams = [engine.submit(Request(f"a{i}", p, GREEDY)) for i, p in enumerate(batch)]
        results = await asyncio.gather(*(abort_after(engine, s, 1) for s in streams))
        await wait_idle(engine)
        return results

    results = asyncio.run(run_engine(engine, abort_while_landing()))
    assert all(reason is FinishReason.ABORT and len(tokens) == 1 for tokens, reason in results)
    assert_pools_free(engine)
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_stopping_with_requests_in_flight_frees_every_block_and_the_engine_restarts(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32))
    batch = prompts([5, 200, 40, 90], seed=9)

    async def stop_midway():
        await engine.start()
        streams = [engine.submit(Request(f"m{i}", p, GREEDY)) for i, p in enumerate(batch)]
        await streams[0].__anext__()                    # one has its first token, others are mid-prefill
        await engine.stop()
        return [event for stream in streams async for event in stream]

    events = asyncio.run(stop_midway())
    assert {e.finish_reason for e in events if e.finished} == {FinishReason.ABORT}
    assert_pools_free(engine)
    async def one_more():
        return await collect(engine.submit(Request("after", batch[0], GREEDY)))

    again = asyncio.run(run_engine(engine, one_more()))
    assert again[1] is FinishReason.LENGTH and len(again[0]) == GREEDY.max_tokens
    assert_pools_free(engine)
    engine.close()
