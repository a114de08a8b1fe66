"""The supervisor: a failing step, a failing bookkeeping call on the loop, or a step stuck past
--step-timeout ends every unfinished request with an error (never a hang), then the engine either
serves again with fresh actors (restart) or is dead (exit): new requests are refused, nothing leaks."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine, EngineStopped
from pdserve.engine.worker import faults
from tests.models import SLOS_SET, demo_checkpoint, engine_config
from tests.test_engine_modes import assert_pools_free, collect, prompts, run_engine

MODES = ("adaptive", "disaggregated", "colocated")
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FAILING_UNIT = {"adaptive": "decode", "disaggregated": "decode", "colocated": "colocated"}


def build(mode: str, monkeypatch, fault: str | None = None, **overrides) -> Engine:
    if fault is not None:
        monkeypatch.setenv(faults.ENV, fault)
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, **SLOS_SET, **overrides))
    monkeypatch.delenv(faults.ENV, raising=False)
    return engine


async def until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def fail_then_serve(engine: Engine, expected: list[int]):
    """Three long requests are failed by the fault; then a new one must give `expected` exactly."""
    streams = [engine.submit(Request(f"doomed{i}", p, LONG)) for i, p in enumerate(prompts([6, 40, 12], seed=1))]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
    await until(lambda: engine.healthy())
    after = await asyncio.wait_for(collect(engine.submit(Request("after", prompts([10], seed=2)[0], SHORT))), 60)
    return results, after


def assert_failed_then_served(engine: Engine, expected: list[int]) -> None:
    """fail_then_serve: every doomed request errors, one restart, the same tokens after, no block held."""
    results, (tokens, _) = asyncio.run(run_engine(engine, fail_then_serve(engine, expected)))
    assert all(r is FinishReason.ERROR for _, r in results) and tokens == expected
    assert engine.supervisor.restarts == 1
    assert_pools_free(engine)
    engine.close()


def reference_tokens(mode: str) -> list[int]:
    engine = Engine(engine_config(demo_checkpoint(), mode=mode))

    async def one():
        return await collect(engine.submit(Request("after", prompts([10], seed=2)[0], SHORT)))

    tokens, _ = asyncio.run(run_engine(engine, one()))
    engine.close()
    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_raises_errors_every_request_and_the_restarted_engine_serves_the_same_tokens(mode, monkeypatch):
    expected = reference_tokens(mode)
    engine = build(mode, monkeypatch, f"{FAILING_UNIT[mode]}:raise@3")
    results, (tokens, reason) = asyncio.run(run_engine(engine, fail_then_serve(engine, expected)))
    assert all(r is FinishReason.ERROR for _, r in results)
    assert (tokens, reason) == (expected, FinishReason.LENGTH)
    assert engine.supervisor.restarts == 1 and engine.dead is None and engine.stats().restarts == 1
    assert_pools_free(engine)
    engine.close()


def test_the_error_event_names_the_actor_and_the_cause(monkeypatch):
    engine = build("disaggregated", monkeypatch, "decode:raise@2")

    async def scenario():
        events = [e async for e in engine.submit(Request("r", prompts([8])[0], LONG))]
        return events[-1]

    last = asyncio.run(run_engine(engine, scenario()))
    assert last.finish_reason is FinishReason.ERROR
    assert "decode actor failed" in last.error and "InjectedFault" in last.error
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_bookkeeping_exception_on_the_loop_is_caught_the_same_way(mode, monkeypatch):
    expected = reference_tokens(mode)
    engine = build(mode, monkeypatch)
    actor = engine.actors[-1]
    real_record, calls = actor.record, []

    def record(batch, outcome):
        calls.append(1)
        if len(calls) == 4:
            raise KeyError("a bookkeeping bug")
        return real_record(batch, outcome)

    actor.record = record                           # the failing actor is discarded; its fresh one is clean
    assert_failed_then_served(engine, expected)


def test_exit_policy_marks_the_engine_dead_and_refuses_new_requests(monkeypatch):
    engine = build("disaggregated", monkeypatch, "decode:raise@2", on_worker_failure="exit")

    async def scenario():
        tokens, reason = await asyncio.wait_for(collect(engine.submit(Request("r", prompts([8])[0], LONG))), 60)
        why = await asyncio.wait_for(engine.wait_dead(), 10)
        with pytest.raises(EngineStopped, match="the engine is dead"):
            engine.submit(Request("late", prompts([8])[0], SHORT))
        return reason, why

    reason, why = asyncio.run(run_engine(engine, scenario()))
    assert reason is FinishReason.ERROR and "InjectedFault" in why
    assert not engine.healthy() and engine.stats().dead
    engine.close()


def test_repeated_failures_give_up_after_the_restart_limit(monkeypatch):
    engine = build("colocated", monkeypatch)
    unit = engine.units.decoding[0]

    def always_failing(work):
        raise RuntimeError("broken device")

    unit.step_runner.run = always_failing

    async def scenario():
        for i in range(10):
            if engine.dead is not None:
                break
            await until(lambda: engine.healthy() or engine.dead is not None)
            if engine.dead is None:
                _, reason = await asyncio.wait_for(collect(engine.submit(Request(f"r{i}", prompts([8])[0], SHORT))), 60)
                assert reason is FinishReason.ERROR
            await until(lambda: not engine.supervisor.recovering)
        return engine.dead

    dead = asyncio.run(run_engine(engine, scenario()))
    assert dead is not None and "restarts within" in dead and engine.supervisor.restarts == 3
    engine.close()


def test_a_thread_stuck_past_the_step_timeout_errors_its_requests_and_the_engine_is_dead(monkeypatch):
    engine = build("disaggregated", monkeypatch, "decode:hang@2", step_timeout=0.5)
    faults.RELEASE.clear()

    async def scenario():
        tokens, reason = await asyncio.wait_for(collect(engine.submit(Request("r", prompts([8])[0], LONG))), 30)
        await asyncio.wait_for(engine.wait_dead(), 10)
        return reason

    try:
        reason = asyncio.run(run_engine(engine, scenario()))
        assert reason is FinishReason.ERROR
        assert "--step-timeout" in engine.dead and "cannot be reclaimed" in engine.dead
        engine.close()                                # does not wait for the stuck thread
    finally:
        faults.RELEASE.set()


def test_stopping_while_actors_restart_finishes_the_restart_so_the_next_start_serves(monkeypatch):
    """LLM.generate stops the engine as soon as its requests end, which a failure makes happen
    while the supervisor is still restarting the actors: the restart must finish, not be cancelled
    half-way (that left abandoned actors to the next start, whose requests then hung)."""
    expected = reference_tokens("colocated")
    engine = build("colocated", monkeypatch, "colocated:raise@3")
    real_restart = engine.restart_actors
    restarting = []

    async def slow_restart(recover_stuck: bool) -> None:
        restarting.append(1)
        await asyncio.sleep(0.2)                      # as long as a real model's abandon + rewire can take
        await real_restart(recover_stuck)

    monkeypatch.setattr(engine, "restart_actors", slow_restart)

    async def fail_and_stop():
        await engine.start()
        stream = engine.submit(Request("doomed", prompts([6], seed=1)[0], LONG))
        _, reason = await asyncio.wait_for(collect(stream), 60)
        await until(lambda: bool(restarting))
        await engine.stop()                           # mid-restart, as LLM.generate does
        return reason

    assert asyncio.run(fail_and_stop()) is FinishReason.ERROR
    assert not engine.supervisor.recovering and engine.supervisor.restarts == 1

    async def serve_again():
        await engine.start()
        try:
            return await asyncio.wait_for(collect(engine.submit(Request("after", prompts([10], seed=2)[0], SHORT))),
                                          60)
        finally:
            await engine.stop()

    assert asyncio.run(serve_again()) == (expected, FinishReason.LENGTH)
    assert_pools_free(engine)
    engine.close()
