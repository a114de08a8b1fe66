"""Adaptive mode: per-request placement, lent cores, and outputs identical to the fixed modes."""
from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.coordinator.planner import LoadState, PlacementPolicy
from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from tests.models import demo_checkpoint, engine_config
from tests.test_async_scheduling import joining_every_step
from tests.test_engine_modes import (
    assert_pools_free,
    collect,
    prompts,
    run_engine,
    staggered,
    wait_idle,
)

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
TINY_TARGET = dict(itl_target_ms=0.001)      # every decode step is "over budget": long prompts go remote


def mixed_requests(seed: int = 0) -> list[Request]:
    lengths = [6, 150, 9, 120, 20, 7, 90, 12, 200, 5, 130, 8]
    return [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(lengths, seed))]


# --- the policy ---------------------------------------------------------------------------------

def seeded_costs(seed: int) -> tuple[StepCostModel, StepCostModel]:
    """Cost models fed noisy observations of known linear costs (decode: 2 threads, prefill: 1)."""
    rng = random.Random(seed)
    decode, prefill = StepCostModel(), StepCostModel()
    for _ in range(40):
        rows, tokens = rng.randrange(1, 32), rng.choice([0, 0, 16, 64])
        decode.observe(2, rows, tokens, (0.02 + 0.001 * rows + 0.0005 * tokens) * rng.uniform(0.95, 1.05))
        chunk = rng.randrange(32, 512)
        prefill.observe(1, 0, chunk, (0.01 + 0.001 * chunk) * rng.uniform(0.95, 1.05))
    return decode, prefill


def state(rows=8, queued=0, backlog=0, long=False) -> LoadState:
    return LoadState(rows, queued, backlog, decode_threads=2, prefill_threads=1, long_queued=long)


def decisions(seed: int) -> list[tuple[bool, int]]:
    policy = PlacementPolicy(*seeded_costs(seed), max_prefill_tokens=512)
    cases = [(0, 500, state(rows=0)), (30, 30, state()), (400, 400, state()), (400, 400, state(backlog=4000)),
             (400, 40, state(backlog=300)), (200, 200, state(queued=900))]
    return [(policy.place(local, remote, s).local, policy.step_budget(s)) for local, remote, s in cases]


def test_placement_is_deterministic_for_a_seeded_cost_model_and_follows_the_costs():
    assert decisions(7) == decisions(7)
    placed = [local for local, _ in decisions(7)]
    assert placed == [True,     # nothing decodes: local at full budget
                      True,     # fits one step's budget (~56 tokens at 8 rows)
                      False,    # long, and the prefill actor is idle: its first token comes sooner there
                      True,     # long, but the prefill actor is 4000 tokens behind
                      False,    # the prefill pool has most of it cached
                      False]    # a long local queue: the idle prefill actor has it done sooner
    assert decisions(7)[5][1] == 512                    # that queue would take many steps: throughput first


def test_the_step_budget_keeps_a_decode_step_within_the_itl_target():
    decode, prefill = seeded_costs(3)
    policy = PlacementPolicy(decode, prefill, max_prefill_tokens=2048, itl_target=0.05)
    budget = policy.step_budget(state(rows=10))
    assert decode.predict(2, 10, budget) == pytest.approx(0.05, rel=0.1)
    assert policy.step_budget(state(rows=0)) == 2048


def slow_decode_costs() -> tuple[StepCostModel, StepCostModel]:
    """Exact linear costs of a slow decode step (1.4 s at 8 rows), as measured with long contexts on
    2 cores: twice that step would let ~7000 prefill tokens ride along."""
    decode, prefill = StepCostModel(), StepCostModel()
    for rows, tokens in [(1, 0), (8, 0), (16, 256), (4, 1024), (12, 64), (2, 2048)]:
        decode.observe(2, rows, tokens, 1.0 + 0.05 * rows + 0.0002 * tokens)
        prefill.observe(1, 0, tokens + 32, 0.01 + 0.0004 * (tokens + 32))
    return decode, prefill


def test_a_long_prompt_goes_remote_while_rows_decode_however_slow_the_decode_step():
    policy = PlacementPolicy(*slow_decode_costs(), max_prefill_tokens=2048)
    assert policy.max_local == 1000                                  # Dynamo's default, under the step's
    assert policy.step_budget(state()) == 1000                       # the ITL budget is capped: not 2048
    placed = policy.place(2048, 2048, state())
    assert not placed.local and "max local prefill length of 1000" in placed.reason
    assert policy.place(1000, 1000, state()).local                   # at the limit: one local step
    assert policy.place(2048, 2048, state(rows=0)).local             # nothing decodes: full budget here
    assert policy.step_budget(state(rows=0)) == 2048


def test_a_long_prompt_stays_local_only_when_the_prefill_actors_backlog_outlasts_it():
    policy = PlacementPolicy(*slow_decode_costs(), max_prefill_tokens=2048)
    # here: 3 steps of 1.4 s decode + 1000 tokens (0.2 s) = 4.8 s; there: the backlog at 0.4 ms a token
    # and 10 ms a 2048-token step
    assert not policy.place(2048, 2048, state(backlog=11000)).local             # 4.46 s behind: still remote
    behind = policy.place(2048, 2048, state(backlog=13000))                     # 5.27 s behind: here
    assert behind.local and "5.27s behind" in behind.reason and "4.80s" in behind.reason
    assert policy.step_budget(state(queued=2048, long=True)) == 1000            # and chunked at the limit


def test_piled_up_local_prompts_take_the_limit_with_a_long_one_queued_else_the_prefill_budget():
    decode, prefill = seeded_costs(3)
    policy = PlacementPolicy(decode, prefill, max_prefill_tokens=2048, itl_target=0.05,
                             max_local_prefill_length=600)
    itl_budget = policy.step_budget(state(rows=10))
    assert itl_budget < 600
    assert policy.step_budget(state(rows=10, queued=itl_budget * 4, long=True)) == itl_budget   # not piled up
    assert policy.step_budget(state(rows=10, queued=itl_budget * 4 + 1, long=True)) == 600     # throughput mode
    assert policy.step_budget(state(rows=10, queued=50_000, long=True)) == 600
    assert policy.step_budget(state(rows=10, queued=itl_budget * 4)) == itl_budget
    assert policy.step_budget(state(rows=10, queued=itl_budget * 4 + 1)) == 2048        # short prompts only:
    assert policy.step_budget(state(rows=10, queued=50_000)) == 2048                    # as colocated takes them
    assert policy.step_budget(state(rows=0, queued=50_000, long=True)) == 2048          # nothing decodes


def test_before_any_step_is_measured_the_length_limit_alone_places():
    policy = PlacementPolicy(StepCostModel(), StepCostModel(), max_prefill_tokens=2048)
    assert policy.step_budget(state(queued=1500, long=True)) == 1000
    assert policy.step_budget(state(queued=1500)) == 2048
    assert not policy.place(1500, 1500, state()).local
    assert policy.place(900, 900, state()).local
    assert policy.place(1500, 1500, state(rows=0)).local


def test_the_length_limit_counts_uncached_tokens_and_stays_within_a_prefill_step():
    policy = PlacementPolicy(*slow_decode_costs(), max_prefill_tokens=512, max_local_prefill_length=4000)
    assert policy.max_local == 512 and policy.step_budget(state(queued=10_000)) == 512
    policy = PlacementPolicy(*slow_decode_costs(), max_prefill_tokens=2048)
    assert policy.place(400, 2048, state()).local            # a 2048-token turn whose history is cached here
    assert not policy.place(2048, 16, state()).local         # one whose history is on the prefill actor


def test_max_local_prefill_length_is_an_engine_option():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).scheduler.max_local_prefill_length is None
    config = engine_config_from_args(parser.parse_args(["--max-local-prefill-length", "512"]))
    assert config.scheduler.max_local_prefill_length == 512
    with pytest.raises(ValueError, match="--max-local-prefill-length must be positive"):
        engine_config_from_args(parser.parse_args(["--max-local-prefill-length", "0"]))


# --- engines ------------------------------------------------------------------------------------

def test_the_prefill_backlog_counts_a_burst_still_in_its_mailbox():
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive"))
    prefill, decode = engine.actors
    requests = mixed_requests(seed=5)
    expected = 0
    for request in requests:                          # placed one after the other, before the loop runs
        assert engine.coordinator.load(decode).remote_backlog_tokens == expected
        prefill.send(request)
        expected += len(request.prompt_token_ids)
    assert prefill.backlog_tokens() == expected
    prefill.drain()                                   # now in its scheduler, and counted once
    assert prefill.backlog_tokens() == expected and len(prefill.scheduler) == len(requests)
    prefill.settle()
    engine.close()


def run(mode: str, requests, joining=staggered, **overrides):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=64, **overrides))
    outputs = asyncio.run(run_engine(engine, joining(engine, requests)))
    return outputs, engine


def test_greedy_identical_in_all_three_modes_with_local_and_remote_prefills():
    requests = mixed_requests()
    outputs = {}
    for mode in ("colocated", "disaggregated", "adaptive"):
        outputs[mode], engine = run(mode, requests, joining_every_step, **(TINY_TARGET if mode == "adaptive" else {}))
        if mode == "adaptive":
            decode = engine.actors[1]
            assert decode.local_prefills > 0 and decode.remote_prefills > 0
        assert_pools_free(engine)
        engine.close()
    assert outputs["adaptive"] == outputs["colocated"] == outputs["disaggregated"]


def test_preempted_sequences_are_placed_again_and_finish_as_in_a_roomy_pool():
    requests = [Request(f"p{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts([40] * 8, seed=4))]
    roomy, engine = run("colocated", requests, max_model_len=256)
    engine.close()
    tight, engine = run("adaptive", requests, max_model_len=256, kv_cache_memory="1MiB", **TINY_TARGET)
    assert engine.actors[1].scheduler.num_preemptions > 0
    assert tight == roomy
    assert_pools_free(engine)
    engine.close()


def test_random_aborts_while_cores_are_lent_leave_both_pools_free():
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive", max_prefill_tokens=48, **TINY_TARGET))
    rng = random.Random(11)

    async def scenario():
        streams = [engine.submit(Request(f"a{i}", p, SamplingParams(max_tokens=30, ignore_eos=True)))
                   for i, p in enumerate(prompts([rng.randrange(3, 150) for _ in range(20)], seed=12))]

        async def consume(stream, stop_after: int):
            seen = 0
            async for _ in stream:
                seen += 1
                if seen >= stop_after:
                    await stream.aclose()
                    return

        await asyncio.gather(*(consume(s, rng.randrange(1, 25)) for s in streams))
        await wait_idle(engine)

    asyncio.run(run_engine(engine, scenario()))
    assert sum(a.lent_steps for a in engine.actors) > 0
    assert_pools_free(engine)
    engine.close()


def test_a_prefill_arriving_while_its_cores_are_lent_starts_within_one_decode_step():
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive", **TINY_TARGET))
    prefill, decode = engine.actors
    starts, threads = [], []
    step_runner = prefill.unit.step_runner
    real_execute, real_threads = step_runner.run, decode.step_threads

    def execute(work):
        starts.append(decode.steps)                    # decode steps completed when this prefill step began
        return real_execute(work)

    def step_threads():
        threads.append((decode.steps, real_threads()))
        return threads[-1][1]

    step_runner.run, decode.step_threads = execute, step_threads

    async def scenario():
        streaming = engine.submit(Request("long-decode", prompts([8])[0],
                                          SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)))
        first = await streaming.__anext__()
        for _ in range(5):
            await streaming.__anext__()                # decoding alone, on every core
        arrived_at = decode.steps
        remote = engine.submit(Request("long-prompt", prompts([400], seed=3)[0], GREEDY))
        await collect(remote)
        await collect(streaming)
        return first, arrived_at

    _, arrived_at = asyncio.run(run_engine(engine, scenario()))
    assert decode.remote_prefills == 1 and starts
    assert starts[0] - arrived_at <= 1
    own, total = decode.share.decode_own, decode.share.total
    assert any(n == total for steps, n in threads if steps < arrived_at)            # lent before
    assert all(n == own for steps, n in threads if starts[0] < steps < starts[-1])   # given back during it
    assert_pools_free(engine)
    engine.close()


def test_on_shared_cores_a_long_prompt_stays_local_while_stalls_are_too_rare_to_reach_the_p99():
    policy = PlacementPolicy(*slow_decode_costs(), max_prefill_tokens=2048, shared_cores=True)
    step = policy.decode_cost.predict(2, 8, 0)                         # 1.4 s: the ITL target is 2.8 s
    placed = policy.place(2048, 2048, state())
    assert placed.local and "3 stalled steps stay within 1% of the last 500 (0 so far)" in placed.reason
    for _ in range(3):
        policy.record_decode_step(2, 8, 5.7, carried_long=True)        # past twice the target: stalls
    policy.record_decode_step(2, 8, 5.5, carried_long=True)            # within it: not a stall
    policy.record_decode_step(2, 8, 9.0, carried_long=False)           # no long prompt's chunk in it
    assert policy.stalls.stalls == 3
    assert not policy.place(2048, 2048, state()).local                # 3 + 3 > 5: the tail would move
    assert policy.place(1500, 1500, state()).local                    # 3 + 2 = 5: still room
    for _ in range(500 - 5):
        policy.record_decode_step(2, 8, step, carried_long=False)
    assert policy.stalls.stalls == 3
    policy.record_decode_step(2, 8, step, carried_long=False)          # the first stall leaves the window
    assert policy.stalls.stalls == 2 and policy.place(2048, 2048, state()).local


def test_on_separate_devices_a_long_prompt_goes_remote_however_rare_the_stalls():
    policy = PlacementPolicy(*slow_decode_costs(), max_prefill_tokens=2048)       # e.g. two GPUs
    assert policy.stalls.stalls == 0 and not policy.place(2048, 2048, state()).local


def test_on_shared_cores_a_short_prompt_goes_in_one_step_when_that_step_stays_short_of_a_stall():
    decode, prefill = seeded_costs(3)                    # decode ~30 ms at 10 rows, ~0.5 ms a prefill token
    shared = PlacementPolicy(decode, prefill, max_prefill_tokens=2048, itl_target=0.05, shared_cores=True)
    separate = PlacementPolicy(decode, prefill, max_prefill_tokens=2048, itl_target=0.05)
    itl_budget = separate.step_budget(state(rows=10, queued=80))
    assert itl_budget == shared.step_budget(state(rows=10, queued=itl_budget)) and 30 < itl_budget < 50
    assert shared.step_budget(state(rows=10, queued=80)) == 80              # within 1.5 targets: whole
    whole = shared._itl_budget(state(rows=10), 1.5)
    assert decode.predict(2, 10, whole) == pytest.approx(0.075, rel=0.1)
    assert shared.step_budget(state(rows=10, queued=whole + 1)) == itl_budget   # past it: chunked as before
    placed = shared.place(80, 80, state(rows=10))
    assert placed.local and f"budget of {whole}" in placed.reason
    assert separate.place(80, 80, state(rows=10)).reason != placed.reason


def test_on_shared_cores_with_the_default_target_a_short_local_queue_goes_into_one_step_whole():
    decode, prefill = seeded_costs(3)                    # decode ~30 ms at 10 rows: the default target ~60 ms
    shared = PlacementPolicy(decode, prefill, max_prefill_tokens=2048, shared_cores=True)
    separate = PlacementPolicy(decode, prefill, max_prefill_tokens=2048)
    itl_budget = separate.step_budget(state(rows=10, queued=150))
    assert itl_budget < 100 and shared.whole_local_queue and not separate.whole_local_queue
    assert shared.step_budget(state(rows=10, queued=150)) >= 150            # whole
    assert shared.step_budget(state(rows=10, queued=1500, long=True)) == 1000     # a long prompt: in chunks
    placed = shared.place(900, 900, state(rows=10))
    assert placed.local and "budget of 1000" in placed.reason
    assert "budget of" not in separate.place(900, 900, state(rows=10)).reason    # it would be chunked
    explicit = PlacementPolicy(decode, prefill, max_prefill_tokens=2048, itl_target=0.05, shared_cores=True)
    assert not explicit.whole_local_queue and explicit.step_budget(state(rows=10, queued=150)) < 150


def test_on_shared_cores_only_steps_carrying_a_long_prompts_chunk_count_as_stalls():
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive", max_local_prefill_length=64, **TINY_TARGET))
    prefill, decode = engine.actors
    assert decode.policy.shared_cores
    carried_long, recorded = [], []
    real_observe, real_record = decode.observe_step, decode.policy.record_decode_step

    def observe_step(batch, seconds, threads):
        if batch.decode:
            carried_long.append(any(chunk.seq.request_id == "long" for chunk in batch.chunks))
        real_observe(batch, seconds, threads)

    def record_decode_step(threads, rows, seconds, carried):
        recorded.append(carried)
        real_record(threads, rows, seconds, carried)

    decode.observe_step, decode.policy.record_decode_step = observe_step, record_decode_step

    async def scenario():
        streaming = engine.submit(Request("decoding", prompts([8])[0],
                                          SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)))
        for _ in range(6):
            await streaming.__anext__()                # decode steps measured: every one is over the tiny target
        arriving = [engine.submit(Request(f"short{i}", p, GREEDY)) for i, p in enumerate(prompts([20, 30], seed=4))]
        arriving.append(engine.submit(Request("long", prompts([200], seed=5)[0], GREEDY)))
        for stream in (*arriving, streaming):
            await collect(stream)

    asyncio.run(run_engine(engine, scenario()))
    assert decode.remote_prefills == 0                 # 4 chunks of at most 64: the stall window had room
    assert recorded == carried_long and sum(carried_long) >= 3 and not all(carried_long)
    assert decode.policy.stalls.stalls == sum(carried_long)      # the short prompts' steps did not count
    assert_pools_free(engine)
    engine.close()
