"""Two prefill and two decode units (`cpu,cpu`) behind the coordinator: transformers' greedy tokens in
every mode with thread and process workers, the work spread over every unit, every pool free after
random aborts at every stage, a conversation's later turns on the unit holding its prefix, and a
failing unit that ends only its own requests."""
from __future__ import annotations

import asyncio
import functools
import random

import pytest
import torch

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.worker import faults
from tests.hf_models import reference_model as hf_reference
from tests.hf_models import HYBRID_ARCHS, MOE_ARCHS, transformers_greedy
from tests.models import SLOS_SET, engine_config, hf_checkpoint
from tests.test_engine_modes import (
    abort_after,
    assert_pools_free,
    collect,
    held_steps,
    prompts,
    run_engine,
    wait_idle,
)

MODES = ("colocated", "disaggregated", "adaptive")
UNITS = dict(prefill_device="cpu,cpu", decode_device="cpu,cpu")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@functools.cache
def reference(arch: str):
    return hf_reference(hf_checkpoint(arch))


@functools.cache
def expected_tokens(arch: str, prompt: tuple[int, ...]) -> list[int]:
    return transformers_greedy(reference(arch), prompt, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def llama3():
    return reference("llama3")


def four_units(mode: str, arch: str = "llama3", **overrides) -> Engine:
    return Engine(engine_config(hf_checkpoint(arch), mode=mode, max_prefill_tokens=32, **UNITS, **overrides))


async def burst(engine: Engine, requests: list[Request]) -> list[list[int]]:
    results = await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
    return [tokens for tokens, _ in results]


async def two_waves(engine: Engine, batch: list[tuple[int, ...]]) -> tuple[list[list[int]], int]:
    """A burst, then a second one of the first's prompts extended (their prefixes cached on the units that
    served them): every answer, and the prompt tokens the second wave found cached."""
    first = await burst(engine, [Request(f"r{i}", p, GREEDY) for i, p in enumerate(batch)])
    longer = [p + q for p, q in zip(batch, prompts([7] * len(batch), seed=12))]
    streams = [engine.submit(Request(f"s{i}", p, GREEDY)) for i, p in enumerate(longer)]
    events = await asyncio.gather(*(collect_events(s) for s in streams))
    second = [[t for e in stream for t in e.token_ids] for stream in events]
    return first + second, sum(stream[-1].num_cached_tokens for stream in events)


# every family in every mode with thread workers; with process workers, each family in one mode
FAMILIES = ("llama3", "mistral-sliding", "gemma2", "gemma3", "gemma4", "phi3", "smollm3") + MOE_ARCHS + HYBRID_ARCHS
CASES = [(arch, mode, "thread") for arch in FAMILIES for mode in MODES] + [
    (arch, MODES[i % len(MODES)], "process") for i, arch in enumerate(FAMILIES)] + [
    ("llama3", mode, "process") for mode in MODES[1:]]


@pytest.mark.parametrize("arch, mode, workers", CASES)
def test_greedy_tokens_are_transformers_on_two_and_two_units_and_every_unit_works(arch, mode, workers):
    """Prompts longer than a prefill chunk and than the sliding windows; a second wave hits the prefix cache
    (a model with recurrent layers caches no prefix: its state at a prefix's end is not kept)."""
    batch = prompts([5, 70, 33, 140, 9, 64], seed=11)
    engine = four_units(mode, arch, workers=workers)
    outputs, cached = asyncio.run(run_engine(engine, two_waves(engine, batch)))
    longer = [p + q for p, q in zip(batch, prompts([7] * len(batch), seed=12))]
    assert outputs == [expected_tokens(arch, prompt) for prompt in batch + longer]
    assert cached == 0 if arch in HYBRID_ARCHS else cached >= 64
    stats = engine.stats().actors
    assert len(stats) == (2 if mode == "colocated" else 4)
    assert len({a.unit for a in stats}) == len(stats)
    if mode == "colocated":
        assert all(a.routed_prefill > 0 for a in stats)
    elif mode == "disaggregated":
        assert all(a.routed_prefill > 0 for a in stats if a.name == "prefill")
        assert all(a.routed_decode > 0 for a in stats if a.name == "decode")
    else:
        assert all(a.routed_prefill > 0 for a in stats if a.name == "decode")
    assert_pools_free(engine)
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_random_aborts_at_every_stage_across_four_units_leave_every_pool_free(mode):
    engine = four_units(mode)
    rng = random.Random(5)

    async def scenario():
        streams = [engine.submit(Request(f"a{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)))
                   for i, p in enumerate(prompts([rng.randint(1, 200) for _ in range(32)], seed=9))]
        engine.abort("a0")                                          # queued
        results = await asyncio.gather(*(abort_after(engine, s, rng.randint(0, 10)) for s in streams))
        await wait_idle(engine)
        return results

    results = asyncio.run(run_engine(engine, scenario()))
    assert_pools_free(engine)
    assert all(reason in (FinishReason.ABORT, FinishReason.LENGTH) for _, reason in results)
    assert sum(reason is FinishReason.ABORT for _, reason in results) >= 16
    assert all(len(tokens) == 24 for tokens, reason in results if reason is FinishReason.LENGTH)
    assert not engine.coordinator.table
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_conversations_later_turns_hit_the_prefix_cache_on_the_unit_that_served_it(mode):
    engine = four_units(mode, **SLOS_SET)    # NOTE: no start-up profile: with one, adaptive twice prefilled a turn uncached
    first = prompts([70, 70], seed=13)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    entry = {"colocated": "colocated", "disaggregated": "prefill", "adaptive": "decode"}[mode]

    def routed() -> list[int]:
        return [a.routed_prefill for a in engine.stats().actors if a.name == entry]

    async def conversations():
        answers = await burst(engine, [Request(f"{c}-1", first[c], greedy) for c in (0, 1)])
        served = routed()
        assert served == [1, 1]                                     # the two first turns went to two units
        history = [first[c] + tuple(answers[c]) for c in (0, 1)]
        cached = {}
        for turn in (2, 3):
            for c in (1, 0):                                        # conversation 1 first: an idle unit 0 ties
                before = routed()
                prompt = history[c] + prompts([5], seed=20 + turn + c)[0]
                events = [e async for e in engine.submit(Request(f"{c}-{turn}", prompt, greedy))]
                after = routed()
                assert [b - a for a, b in zip(before, after)] == [int(u == c) for u in (0, 1)]
                cached[c, turn] = events[-1].num_cached_tokens
                history[c] = prompt + tuple(t for e in events for t in e.token_ids)
        return cached

    cached = asyncio.run(run_engine(engine, conversations()))
    prefills = {a.unit: (a.routed_prefill, a.routed_decode) for a in engine.stats().actors}
    assert all(tokens >= 64 for tokens in cached.values()), (cached, prefills)
    assert_pools_free(engine)
    engine.close()


def test_a_prompt_goes_to_the_idle_prefill_unit_not_to_one_whose_queue_is_empty_because_it_is_prefilling():
    """A scheduled step's chunks leave its unit's queue: routing counts them until the step ends."""
    engine = four_units("disaggregated")
    first, second = engine.coordinator.prefill

    async def scenario():
        started, release = held_steps(first.unit)       # once started: its warm-up steps are not held
        long, short = prompts([30, 20], seed=5)
        reading = asyncio.ensure_future(collect(engine.submit(Request("long", long, GREEDY))))
        await asyncio.to_thread(started.wait, 30.0)
        assert first.backlog_tokens() == 0 and first.prefill_tokens_in_flight == 30
        answer = await collect(engine.submit(Request("short", short, GREEDY)))
        release.set()
        return answer, await reading

    asyncio.run(run_engine(engine, scenario()))
    assert (first.routed_prefill, second.routed_prefill) == (1, 1)     # the short one did not wait behind it
    assert_pools_free(engine)
    engine.close()


def test_units_of_one_kind_weigh_a_prompt_and_a_row_at_one_price_whatever_their_own_fits_read():
    engine = four_units("adaptive")
    decode = engine.coordinator.decode
    for actor, per_token in zip(decode, (3e-4, 1e-5)):          # one kind of unit, two noisy fits 30x apart
        threads = actor.share and actor.share.decode_own
        for _ in range(4):
            for tokens in (16, 32, 64, 128, 256):
                actor.cost.observe(threads, 0, tokens, 0.002 + per_token * tokens)
            for rows in (1, 2, 4, 8):
                actor.cost.observe(threads, rows, 0, 0.003 + 100 * per_token * rows)
    own = [a.cost.seconds_per_prefill_token(a.share and a.share.decode_own) for a in decode]
    assert own[0] > 10 * own[1]
    rates = [engine.coordinator._prefill_rate(a, decode) for a in decode]
    assert rates[0] == rates[1] == pytest.approx(sum(own) / 2)
    assert engine.coordinator._step_after(decode[0]) == engine.coordinator._step_after(decode[1])
    engine.close()


@pytest.mark.parametrize("workers,fault", [("thread", "raise"), ("process", "exit")])
def test_a_failing_unit_ends_only_its_requests_while_the_others_finish_and_it_serves_again(workers, fault,
                                                                                           monkeypatch, llama3):
    monkeypatch.setenv(faults.ENV, f"decode1:{fault}@4")
    engine = four_units("disaggregated", workers=workers, **SLOS_SET)
    monkeypatch.delenv(faults.ENV)
    batch = prompts([12, 40, 7, 25, 60, 18, 33, 9], seed=17)
    health_while_down = []
    restart_unit = engine.restart_unit

    async def observed_restart(actor, recover_stuck):
        health_while_down.append(engine.units_up())
        await restart_unit(actor, recover_stuck)

    engine.restart_unit = observed_restart

    async def scenario():
        first = await asyncio.gather(*(collect_events(engine.submit(Request(f"f{i}", p, GREEDY)))
                                       for i, p in enumerate(batch)))
        await asyncio.gather(*engine.supervisor.units_down.values())        # decode1's restart
        assert all(unit["up"] for unit in engine.units_up())
        again = await burst(engine, [Request(f"g{i}", p, GREEDY) for i, p in enumerate(batch)])
        return first, again

    first, again = asyncio.run(run_engine(engine, scenario()))
    expected = [llama3.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist() for p in batch]
    failed = [events[-1] for events in first if events[-1].finish_reason is FinishReason.ERROR]
    finished = [(i, events) for i, events in enumerate(first) if events[-1].finish_reason is FinishReason.LENGTH]
    assert failed and finished and len(failed) + len(finished) == len(batch)
    assert all("decode1" in event.error for event in failed)
    assert all([t for e in events for t in e.token_ids] == expected[i] for i, events in finished)
    assert again == expected
    assert engine.supervisor.restarts == 1 and engine.dead is None
    [health] = health_while_down
    assert [{k: v for k, v in unit.items() if k != "error"} for unit in health] == [
        {"unit": u, "role": u[:-1], "up": u != "decode1", "state": "restarting" if u == "decode1" else "up"}
        for u in ("prefill0", "prefill1", "decode0", "decode1")]
    assert "the decode1 unit failed" in health[3]["error"] and all("error" not in unit for unit in health[:3])
    assert {a.unit for a in engine.stats().actors if a.routed_decode} == {"decode0", "decode1"}  # fresh decode1 too
    assert_pools_free(engine)
    engine.close()


async def collect_events(stream) -> list:
    return [event async for event in stream]
