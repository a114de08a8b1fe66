"""Adaptive mode in an engine: the planner's placements, lent cores, and outputs identical to the fixed modes
(the planner's decisions on seeded cost models: tests/test_planner.py)."""
from __future__ import annotations

import asyncio
import logging
import random

import pytest

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.coordinator.coordinator import Route
from pdserve.engine.modes.adaptive.decisions import Stream
from pdserve.engine.modes.adaptive.planner import Planner
from pdserve.engine.modes.adaptive.prefill_plans import Waiting
from pdserve.engine.coordinator.slo import Slos
from pdserve.engine.core.batch import attention_pairs
from pdserve.engine.core.messages import Request
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.engine import Engine
from tests.models import demo_checkpoint, engine_config
from tests.test_async_scheduling import joining_every_step
from tests.test_engine_modes import (
    assert_pools_free,
    collect,
    held_steps,
    prompts,
    run_engine,
    staggered,
    wait_idle,
)

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SLOS = dict(ttft_slo_ms=100.0, itl_slo_ms=50.0, startup_profile=False)   # no start-up profile: the seeded costs alone


class FrozenCost(StepCostModel):
    """Known linear step costs that the engine's own steps do not move (decisions follow the seed alone)."""

    def observe(self, *args, **kwargs) -> None:
        pass


def frozen(fixed: float, per_row: float, per_token: float, speedup: float) -> FrozenCost:
    """Those costs at one thread (and unpinned), `speedup` times faster at two."""
    cost = FrozenCost()
    for threads, scale in ((None, 1.0), (1, 1.0), (2, 1.0 / speedup)):
        for rows, tokens in [(0, 1), (1, 0), (8, 0), (16, 64), (4, 512), (0, 256), (2, 32)]:
            StepCostModel.observe(cost, threads, rows, tokens, scale * (fixed + per_row * rows + per_token * tokens))
    return cost


def seed_costs(engine: Engine, speedup: float = 1.0) -> Engine:
    """Decode steps of 5 ms + 1 ms a row + 0.5 ms a prefill token, prefill steps of 10 ms + 0.2 ms a token: with
    the SLOS, a short prompt is prefilled where it decodes, a long one on the prefill unit."""
    for actor in engine.actors:
        prefilling = actor in engine.coordinator.prefill
        actor.cost = frozen(0.01, 0.0, 0.0002, speedup) if prefilling else frozen(0.005, 0.001, 0.0005, speedup)
        engine.mode.costs["prefill" if prefilling else "decode", actor.index] = actor.cost
    return engine


def mixed_requests(seed: int = 0) -> list[Request]:
    lengths = [6, 150, 9, 120, 20, 7, 90, 12, 200, 5, 130, 8]
    return [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(lengths, seed))]


# --- engines ------------------------------------------------------------------------------------

def test_the_prefill_backlog_counts_a_burst_still_in_its_mailbox():
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive"))
    prefill, decode = engine.actors
    requests = mixed_requests(seed=5)
    expected = 0
    for request in requests:                          # placed one after the other, before the loop runs
        assert engine.mode.placement.load(decode).remote_backlog_tokens == expected
        prefill.send(request)
        expected += len(request.prompt_token_ids)
    assert prefill.backlog_tokens() == expected
    prefill.drain()                                   # now in its scheduler, and counted once
    assert prefill.backlog_tokens() == expected and len(prefill.scheduler) == len(requests)
    prefill.clear()
    engine.close()


def test_queued_prompts_count_only_the_tokens_their_prefix_cache_hits_leave_to_compute():
    """A later turn queued on the unit that holds its history computes only its new tokens: the planner's queue
    and the backlog routing reads count those, not its whole length (which sent later turns to a cold unit)."""
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive"))
    prefill, decode = engine.actors
    history = tuple(prompts([160], seed=9)[0])
    earlier = Sequence(Request("turn1", history))
    size = decode.blocks.block_size
    extend_hashes(earlier, earlier.num_tokens, size)
    decode.blocks.grow("turn1", len(history))
    decode.blocks.register("turn1", earlier.block_hashes)
    decode.blocks.free("turn1")
    later = Request("turn2", history + tuple(prompts([24], seed=10)[0]), GREEDY)
    for actor in (decode, prefill):
        actor.send(later)
        actor.drain()
    cached = len(history) // size * size
    assert [q.tokens for q in decode.queued()] == [len(later.prompt_token_ids) - cached]
    assert decode.backlog_tokens() == len(later.prompt_token_ids) - cached
    assert [q.tokens for q in prefill.queued()] == [len(later.prompt_token_ids)]      # a cold pool
    decode.clear(), prefill.clear()
    engine.close()


def run(mode: str, requests, joining=staggered, **overrides):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=64, **overrides))
    if mode == "adaptive":
        seed_costs(engine)
    outputs = asyncio.run(run_engine(engine, joining(engine, requests)))
    return outputs, engine


def test_greedy_identical_in_all_three_modes_with_local_and_remote_prefills():
    requests = mixed_requests()
    outputs = {}
    for mode in ("colocated", "disaggregated", "adaptive"):
        outputs[mode], engine = run(mode, requests, joining_every_step, **SLOS)
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
    tight, engine = run("adaptive", requests, max_model_len=256, kv_cache_memory="1MiB", **SLOS)
    assert engine.actors[1].scheduler.num_preemptions > 0
    assert tight == roomy
    assert_pools_free(engine)
    engine.close()


def test_random_aborts_while_cores_are_lent_leave_both_pools_free():
    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", max_prefill_tokens=48, **SLOS)),
                        speedup=2.0)
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
    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)), speedup=2.0)
    prefill, decode = engine.actors
    starts, threads = [], []
    step_runner = prefill.unit.step_runner
    real_execute, real_threads = step_runner.run, decode.step_threads

    def execute(work):
        starts.append(decode.steps)                    # decode steps completed when this prefill step began
        return real_execute(work)

    def step_threads(batch):
        threads.append((decode.steps, real_threads(batch)))
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


def test_a_unit_whose_cores_are_lent_steps_only_after_the_lent_step():
    """A long prompt goes to the prefill unit, which borrows the idle decode unit's cores; a short one placed
    on the decode unit meanwhile waits for that step to end (stepping beside it, three threads on two cores
    stalled a lent step 12x). The lent step is held until the decode unit has had its chance to launch."""
    import threading
    import time

    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)), speedup=2.0)
    prefill, decode = engine.actors
    if decode.share is None:
        pytest.skip("core lending needs CPU units with cores of their own (two cores or more)")
    spans, lent_started, decode_started, release = [], threading.Event(), threading.Event(), threading.Event()

    def recorded(actor, started_event, hold):
        run = actor.unit.step_runner.run

        def execute(work):
            started = time.perf_counter()
            started_event.set()
            if hold and work.threads == decode.share.total and not release.is_set():
                release.wait()
            outcome = run(work)
            spans.append((actor.unit_name, work.threads, started, time.perf_counter()))
            return outcome
        actor.unit.step_runner.run = execute

    recorded(prefill, lent_started, hold=True)
    recorded(decode, decode_started, hold=False)

    async def scenario():
        long = engine.submit(Request("long", prompts([400], seed=3)[0], GREEDY))
        reading = asyncio.ensure_future(collect(long))
        await asyncio.to_thread(lent_started.wait, 10.0)
        decode_started.clear()
        short = engine.submit(Request("short", prompts([6], seed=4)[0], GREEDY))
        await asyncio.to_thread(decode_started.wait, 2.0)   # NOTE: a bound on the wait, not on the outcome
        release.set()
        return await collect(short), await reading

    asyncio.run(run_engine(engine, scenario()))
    lent = [(start, end) for unit, threads, start, end in spans if unit == prefill.unit_name
            and threads == decode.share.total]
    assert lent and decode.local_prefills >= 1 and decode.remote_prefills >= 1
    beside = [(start, end) for unit, _, start, end in spans if unit == decode.unit_name
              for lent_start, lent_end in lent if lent_start < start < lent_end]
    assert beside == []
    assert_pools_free(engine)
    engine.close()


def test_the_prefill_units_step_in_flight_is_in_the_load_the_planner_reads():
    """A step's chunks leave the prefill unit's queue when it is scheduled: the load lists the step in flight
    instead (what it prefills, its threads, how long it has run), and nothing once it has finished."""
    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)))
    prefill, decode = engine.actors
    started, release = held_steps(prefill.unit)

    async def scenario():
        long = engine.submit(Request("long", prompts([400], seed=3)[0], GREEDY))
        reading = asyncio.ensure_future(collect(long))
        await asyncio.to_thread(started.wait, 30.0)
        await asyncio.sleep(0.05)
        during = engine.mode.placement.load(decode)
        release.set()
        await reading
        return during, engine.mode.placement.load(decode)

    during, after = asyncio.run(run_engine(engine, scenario()))
    assert decode.remote_prefills == 1
    assert during.remote_backlog_tokens == 0 and [r.tokens for r in during.remote_running] == [400]
    assert during.remote_running[0].pairs == attention_pairs(0, 400) and during.remote_running_for >= 0.05
    own = decode.share and decode.share.prefill_own
    assert during.remote_running[0].threads in {own, decode.share and decode.share.total}
    assert after.remote_running == () and after.remote_running_for == 0.0
    assert_pools_free(engine)
    engine.close()


def test_the_prefill_units_next_step_carries_what_the_planner_decides_off_its_queue_in_order():
    """Seeded costs: 10 ms + 0.2 ms a prompt token, so a short prompt packed with a 2,000-token one waits 0.42 s."""
    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)))
    prefill, decode = engine.actors
    engine.mode.placement.planner = Planner(Slos(ttft=1.0, itl=0.05), 2048)
    for name, length in (("short", 40), ("long", 2000)):
        prefill.scheduler.add(Sequence(Request(name, prompts([length])[0], GREEDY, arrival_time=100.0)))
    assert [s.request_id for s in prefill.scheduler.in_order()] == ["short", "long"]
    budgets = {}
    for now in (100.0, 100.7):
        engine.coordinator.clock = lambda: now
        budgets[now] = engine.mode.placement.prefill_budget(prefill)
    assert budgets == {100.0: 2048, 100.7: 40}            # at 100.7 the packed step puts the short one past 1 s
    for name in ("short", "long"):
        prefill.scheduler.remove(prefill.scheduler.find(name))
    engine.close()


def test_the_planner_reads_waiting_times_off_the_coordinators_clock():
    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)))
    prefill, decode = engine.actors
    decode.local.add(Sequence(Request("queued", prompts([40])[0], GREEDY, arrival_time=100.0)))
    planner = Planner(Slos(ttft=1.0, itl=0.05), 2048)
    misses = {}
    for now in (100.2, 103.5):                             # a virtual clock, as a simulator hands in
        engine.coordinator.clock = lambda: now
        state = engine.mode.placement.load(decode, decode_rows=2)
        assert state.local_queue == (Waiting(40, pytest.approx(now - 100.0), 40),)
        misses[now] = planner.step_budget(state, decode.cost).chosen.ttft_misses
    assert misses == {100.2: 0, 103.5: 1}                 # past its TTFT SLO only by the later clock
    decode.local.remove(decode.local.find("queued"))
    engine.close()


@pytest.mark.parametrize("slos", [{}, dict(ttft_slo_ms=800.0, itl_slo_ms=100.0)], ids=["derived", "stated"])
def test_the_units_cost_models_start_from_the_start_up_profile(slos):
    """With SLOs stated too: the planner's first decisions need measured steps as much as derived SLOs do."""
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive", max_num_seqs=8, max_prefill_tokens=2048, **slos,
                                  enable_prefix_caching=False))   # long enough steps that a fit's noise is small
    prefill, decode = engine.actors
    decode_threads, prefill_threads = (decode.share.decode_own, decode.share.prefill_own) if decode.share else \
        (None, None)
    assert not decode.cost.measured(decode_threads) and not prefill.cost.measured(prefill_threads)

    async def started():
        return None

    asyncio.run(run_engine(engine, started()))                  # nothing served: only the profile's steps
    assert decode.cost.measured(decode_threads)
    assert prefill.cost.seconds_per_prefill_token(prefill_threads) > 0
    assert prefill.cost.predict(prefill_threads, 0, 512) > prefill.cost.predict(prefill_threads, 0, 1)
    if decode.share is not None:                                # it prefills on its own cores too
        assert decode.cost.seconds_per_prefill_token(decode_threads) > 0
        assert decode.cost.predict(decode_threads, 4, 512) > decode.cost.predict(decode_threads, 4, 0) + \
            0.5 * (decode.cost.predict(decode_threads, 0, 512) - decode.cost.predict(decode_threads, 0, 0))
    if decode.share is not None:                                # and on the lent cores, both phases
        total = decode.share.total
        assert decode.cost.seconds_per_prefill_token(total) > 0 and prefill.cost.seconds_per_prefill_token(total) > 0
        assert decode.cost.measured(total) and decode.cost.predict(total, 0, 512) > decode.cost.predict(total, 0, 1)
    engine.close()


def test_the_planner_reads_each_streams_decoding_so_far_off_the_coordinators_clock():
    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)))
    prefill, decode = engine.actors
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    seq = Sequence(Request("decoding", prompts([40])[0], params), output_token_ids=[7, 7])
    engine.coordinator.table["decoding"] = Route(decode=decode.index)
    decode.scheduler.add(seq)
    streams = {}
    for now, tokens in ((10.0, 0), (10.3, 3)):          # first seen at 10.0; three tokens in 0.3 s since
        seq.output_token_ids += [7] * tokens
        engine.coordinator.clock = lambda: now
        streams[now] = engine.mode.placement.load(decode).streams
    assert streams == {10.0: (Stream(0, 0.0, 48),), 10.3: (Stream(3, pytest.approx(0.3), 45),)}
    seq.done = True                                      # finished; its row still in the step in flight
    assert engine.mode.placement.load(decode).streams[0].remaining == 0
    seq.done = False
    decode.scheduler.remove(seq)
    engine.coordinator.finished("decoding")
    engine.close()


def test_derived_slos_are_logged_once_at_start_with_their_source(caplog):
    engine = Engine(engine_config(demo_checkpoint(), mode="adaptive", max_num_seqs=16, max_prefill_tokens=64))
    assert engine.slos is None and engine.mode.placement.planner is None        # nothing measured before start

    async def one():
        return await collect(engine.submit(Request("r", prompts([12])[0], GREEDY)))

    with caplog.at_level(logging.INFO, logger="pdserve.engine.engine"):
        tokens, _ = asyncio.run(run_engine(engine, one()))
    assert len(tokens) == GREEDY.max_tokens
    logged = [r.getMessage() for r in caplog.records if "SLO" in r.getMessage()]
    assert len(logged) == 1 and logged[0] == engine.slos.describe()
    assert "decode step of" in logged[0] and "at context 64" in logged[0]       # the knee, or a full batch below it
    assert "first token of a typical 16-token prompt" in logged[0]             # a quarter of the prefill step
    assert engine.mode.placement.planner.slos is engine.slos
    engine.close()


def test_lending_weighs_a_verify_steps_rows_and_drafts():
    """A step whose rows all verify drafts has no plain decode rows: the lending decision must still see its
    rows, their context and their drafts (it saw an empty step, and kept such steps on the unit's own core)."""
    from pdserve.engine.core.batch import Batch

    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", **SLOS)), speedup=2.0)
    prefill, decode = engine.actors
    planner, asked = Planner(Slos(ttft=1.0, itl=0.05), 2048), []
    engine.mode.placement.planner = planner
    real_lend = planner.lend
    planner.lend = lambda *args: asked.append(args) or real_lend(*args)
    seq = Sequence(Request("verifying", list(range(3, 43)), GREEDY))
    seq.num_computed_tokens = 40
    batch = Batch(verify=(seq,), verify_positions=(39,), verify_drafts=((5, 6, 7),))
    engine.mode.placement.step_threads(decode, batch, 1, 2)      # one core of its own, two while the partner idles
    _, own, total, rows, tokens, context, _, drafts, pairs = asked[-1]
    assert (own, total) == (1, 2)
    assert (rows, tokens, context, drafts, pairs) == (1, 0, 40, 3, 0)
    engine.close()


@pytest.mark.parametrize("prefill_units", [1, 2])
def test_a_prefill_unit_borrows_within_the_ttft_slo_unless_another_can_hand_off_meanwhile(prefill_units):
    """Lending needs an idle partner: a decode unit with no stream, where what waits for the lent step is a prompt's
    first token. Bounded by the ITL SLO, a 512-token prompt step sent to the prefill unit ran on one core while
    the same step kept on the decode unit ran on two. With a second prefill unit a stream can arrive meanwhile,
    and the ITL SLO bounds the step again."""
    from pdserve.engine.core.batch import Batch, ScheduledChunk

    engine = seed_costs(Engine(engine_config(demo_checkpoint(), mode="adaptive", prefill_device=",".join(
        ["cpu"] * prefill_units), **SLOS)), speedup=2.0)
    prefill, decode = engine.coordinator.prefill[0], engine.coordinator.decode[0]
    planner, asked = Planner(Slos(ttft=1.0, itl=0.05), 2048), []
    engine.mode.placement.planner = planner
    real_lend = planner.lend
    planner.lend = lambda *args: asked.append(args) or real_lend(*args)
    seq = Sequence(Request("prompt", list(range(3, 515)), GREEDY))
    batch = Batch.of(chunks=(ScheduledChunk(seq, 0, 512, True),))
    engine.mode.placement.step_threads(prefill, batch, 1, 2)
    assert asked[-1][6] == (1.0 if prefill_units == 1 else 0.05)
    engine.mode.placement.step_threads(decode, batch, 1, 2)
    assert asked[-1][6] == 1.0
    engine.close()
