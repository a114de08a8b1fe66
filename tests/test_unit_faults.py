"""Faults stay local with many units: a unit that cannot be restarted (its restart raises) or a thread
stuck in a step is retired while the other units serve on, with transformers' greedy tokens, /health
saying which unit is down and why, and every pool free; only when the last unit of a role the mode
needs is gone is the engine dead (503s); `--on-worker-failure exit` exits on any unit's failure."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from pdserve.engine.coordinator.coordinator import Coordinator, Route
from pdserve.engine.core.messages import Abort, FinishReason, Preempted, Request
from pdserve.engine import supervisor
from pdserve.engine.engine import Engine, EngineStopped
from pdserve.engine.modes import MODES
from pdserve.engine.worker import faults
from pdserve.server.metrics import Metrics
from tests.models import SLOS_SET
from tests.test_coordinator import GREEDY, burst, collect_events, four_units, llama3  # noqa: F401  (fixture)
from tests.test_engine_modes import assert_pools_free, prompts, run_engine
from tests.test_server_api import scrape, serve  # noqa: F401  (fixture)

BATCH = prompts([12, 40, 7, 25, 60, 18, 33, 9], seed=17)


def greedy(model, prompt) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()


def armed(monkeypatch, fault: str, mode: str, **overrides) -> Engine:
    monkeypatch.setenv(faults.ENV, fault)
    engine = four_units(mode, **SLOS_SET, **overrides)
    monkeypatch.delenv(faults.ENV)
    return engine


def unit_of(engine: Engine, name: str):
    return next(a.unit for a in engine.actors if a.unit_name == name)


def cannot_restart(engine: Engine, name: str) -> None:
    """Unit `name`'s restart raises, as a worker that cannot be spawned again or a lost device would."""
    async def lost(force: bool) -> None:
        raise RuntimeError("the device is lost")

    unit_of(engine, name).recover = lost


async def fail_then_serve(engine: Engine):
    """A burst the fault hits, the failed unit's recovery, /health then, and a second burst."""
    first = await asyncio.gather(*(collect_events(engine.submit(Request(f"f{i}", p, GREEDY)))
                                   for i, p in enumerate(BATCH)))
    await asyncio.gather(*engine.supervisor.units_down.values())
    assert engine.healthy()                          # serving, one unit retired
    health = engine.units_up()
    again = await burst(engine, [Request(f"g{i}", p, GREEDY) for i, p in enumerate(BATCH)])
    return first, health, again


def assert_retired_and_served(engine: Engine, name: str, run, expected: list[list[int]]) -> list[dict]:
    """Only `name`'s requests failed, the others gave `expected`, the second burst all of it, `name` is
    retired (in /health, the stats and the metrics) and nothing was routed to it since; returns /health."""
    first, health, again = run
    failed = [events[-1] for events in first if events[-1].finish_reason is FinishReason.ERROR]
    finished = [(i, events) for i, events in enumerate(first) if events[-1].finish_reason is FinishReason.LENGTH]
    assert failed and finished and len(failed) + len(finished) == len(BATCH)
    assert all(f"the {name} unit failed" in event.error for event in failed)
    assert all([t for e in events for t in e.token_ids] == expected[i] for i, events in finished)
    assert again == expected
    assert [(u["unit"], u["up"], u["state"]) for u in health] == [
        (u, u != name, "retired" if u == name else "up") for u in (a.unit_name for a in engine.actors)]
    assert engine.dead is None and engine.supervisor.restarts == 0
    stats = {a.unit: a for a in engine.stats().actors}
    assert [u for u, a in stats.items() if a.retired] == [name]
    assert stats[name].routed_prefill == stats[name].routed_decode == 0 and stats[name].steps == 0
    text = Metrics(engine.stats, list).render().decode()
    assert f'pdserve_unit_retired{{actor="{stats[name].name}",unit="{name}"}} 1.0' in text
    assert_pools_free(engine)
    return health


@pytest.mark.parametrize("mode,name,fault,workers", [
    ("disaggregated", "decode1", "raise@3", "thread"), ("disaggregated", "prefill0", "raise@2", "thread"),
    ("adaptive", "decode1", "raise@3", "thread"), ("colocated", "colocated1", "raise@3", "thread"),
    ("disaggregated", "decode1", "exit@3", "process")])           # the worker dies, and cannot be spawned again
def test_a_unit_whose_restart_fails_is_retired_and_the_others_serve_to_the_end(mode, name, fault, workers,
                                                                               monkeypatch, llama3):
    engine = armed(monkeypatch, f"{name}:{fault}", mode, workers=workers)
    cannot_restart(engine, name)
    run = asyncio.run(run_engine(engine, fail_then_serve(engine)))
    health = assert_retired_and_served(engine, name, run, [greedy(llama3, p) for p in BATCH])
    why = next(u["error"] for u in health if u["unit"] == name)
    assert ("InjectedFault" if workers == "thread" else "WorkerDied") in why
    assert "restarting failed: RuntimeError: the device is lost" in why
    engine.close()


def test_a_unit_that_keeps_failing_is_retired_at_the_restart_limit_and_the_other_serves(monkeypatch, llama3):
    monkeypatch.setattr(supervisor, "RESTART_WINDOW_S", 1e9)     # every restart of this test counts
    engine = four_units("colocated", **SLOS_SET)

    def broken(work):
        raise RuntimeError("broken device")

    unit_of(engine, "colocated1").step_runner.run = broken      # its fresh actors step on the same unit
    rounds = [prompts([12, 40], seed=30 + r) for r in range(supervisor.MAX_RESTARTS + 2)]

    async def scenario():
        results = []
        for r, pair in enumerate(rounds):                        # the second prompt goes to the idle colocated1
            streams = [engine.submit(Request(f"r{r}-{i}", p, GREEDY)) for i, p in enumerate(pair)]
            results.append(await asyncio.gather(*(collect_events(s) for s in streams)))
            await asyncio.gather(*engine.supervisor.units_down.values())
        return results, engine.units_up()

    results, health = asyncio.run(run_engine(engine, scenario()))
    *failing, last = results
    for pair, (first, second) in zip(rounds, failing):
        assert [t for e in first for t in e.token_ids] == greedy(llama3, pair[0])
        assert second[-1].finish_reason is FinishReason.ERROR and "colocated1" in second[-1].error
    assert [[t for e in events for t in e.token_ids] for events in last] == [greedy(llama3, p) for p in rounds[-1]]
    assert engine.supervisor.restarts == supervisor.MAX_RESTARTS and engine.dead is None
    assert [u["state"] for u in health] == ["up", "retired"]
    assert f"{supervisor.MAX_RESTARTS} restarts within" in health[1]["error"]
    assert_pools_free(engine)
    engine.close()


def test_a_thread_unit_stuck_past_the_step_timeout_is_retired_and_the_others_serve(monkeypatch, llama3):
    engine = armed(monkeypatch, "decode1:hang@3", "disaggregated", step_timeout=2.0)
    faults.RELEASE.clear()
    try:
        run = asyncio.run(run_engine(engine, fail_then_serve(engine)))
        health = assert_retired_and_served(engine, "decode1", run, [greedy(llama3, p) for p in BATCH])
        why = next(u["error"] for u in health if u["unit"] == "decode1")
        assert "--step-timeout" in why and "cannot be reclaimed" in why
        engine.close()                                  # does not wait for the stuck thread
    finally:
        faults.RELEASE.set()


def test_a_stuck_prefill_unit_keeps_only_the_decode_blocks_its_stuck_step_writes(monkeypatch, llama3):
    """The stuck step would still copy into its reservations if it ever returned: those stay held, every
    other block is free, and the engine serves on the other units with the right tokens."""
    engine = armed(monkeypatch, "prefill0:hang@2", "disaggregated", step_timeout=2.0)
    faults.RELEASE.clear()
    try:
        first, health, again = asyncio.run(run_engine(engine, fail_then_serve(engine)))
        assert again == [greedy(llama3, p) for p in BATCH]
        assert [u["state"] for u in health] == ["retired", "up", "up", "up"]
        assert any(events[-1].finish_reason is FinishReason.ERROR for events in first)
        decode = [a.blocks for a in engine.coordinator.decode]
        assert all(blocks.num_used == blocks.num_deferred for blocks in decode)   # held back, under no request
        assert sum(blocks.num_used for blocks in decode) > 0
        for blocks in decode:
            blocks.check_consistency()
        assert all(a.blocks.num_used == 0 for a in engine.coordinator.prefill)
        engine.close()
    finally:
        faults.RELEASE.set()


async def test_the_last_unit_of_a_role_gone_kills_the_engine_with_503s(serve, monkeypatch):
    engine = armed(monkeypatch, "decode1:raise@3", "disaggregated")
    for name in ("decode0", "decode1"):
        cannot_restart(engine, name)
    base = await serve(engine)
    first = await asyncio.gather(*(collect_events(engine.submit(Request(f"f{i}", p, GREEDY)))
                                   for i, p in enumerate(BATCH)))
    await asyncio.gather(*engine.supervisor.units_down.values())
    assert any(events[-1].finish_reason is FinishReason.ERROR for events in first)
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/health") as health:
            body = await health.json()
        assert health.status == 200 and body["status"] == "degraded"
        assert [u["state"] for u in body["units"]] == ["up", "up", "up", "retired"]
        assert "the device is lost" in body["units"][3]["error"]

        def broken(work):
            raise RuntimeError("broken device")

        unit_of(engine, "decode0").step_runner.run = broken
        async with session.post(base + "/v1/completions", json={"model": engine.model_name, "prompt": "hi",
                                                                "max_tokens": 4}) as reply:
            assert reply.status == 500 and "decode0" in (await reply.json())["error"]["message"]
        why = await asyncio.wait_for(engine.wait_dead(), 30)
        assert "the decode0 actor failed" in why and "the device is lost" in why
        for method, path in (("GET", "/health"), ("POST", "/v1/completions")):
            async with session.request(method, base + path, json={"model": engine.model_name, "prompt": "hi"}) as r:
                assert r.status == 503 and "dead" in (await r.json())["error"]["message"]
    metrics = await scrape(base)
    assert metrics["pdserve_engine_dead", ()] == 1.0
    assert metrics["pdserve_unit_retired", (("actor", "decode"), ("unit", "decode1"))] == 1.0
    with pytest.raises(EngineStopped, match="the engine is dead"):
        engine.submit(Request("late", BATCH[0], GREEDY))
    engine.close()


def test_exit_policy_exits_on_any_units_failure_even_with_others_serving(monkeypatch):
    engine = armed(monkeypatch, "decode1:raise@3", "disaggregated", on_worker_failure="exit")

    async def scenario():
        first = await asyncio.gather(*(collect_events(engine.submit(Request(f"f{i}", p, GREEDY)))
                                       for i, p in enumerate(BATCH)))
        return first, await asyncio.wait_for(engine.wait_dead(), 30)

    first, why = asyncio.run(run_engine(engine, scenario()))
    reasons = [events[-1].finish_reason for events in first]
    assert FinishReason.ERROR in reasons and set(reasons) <= {FinishReason.ERROR, FinishReason.LENGTH}
    assert "decode1" in why and "--on-worker-failure exit" in why
    assert not engine.healthy() and engine.stats().dead
    engine.close()


def fake_units(mode: str) -> Coordinator:
    def actor(name: str) -> SimpleNamespace:
        return SimpleNamespace(unit_name=name, name=name[:-1], index=int(name[-1]), alive=True)

    if mode == "colocated":
        prefill, decoding = [], [actor("colocated0"), actor("colocated1")]
    else:
        prefill, decoding = [actor("prefill0"), actor("prefill1")], [actor("decode0"), actor("decode1")]
    rules = MODES[mode]()
    return Coordinator(prefill, decoding, rules.entry_role, rules.needs_prefill_units)


@pytest.mark.parametrize("mode,retired,failing,alone", [
    ("disaggregated", "prefill0", "prefill1", False), ("disaggregated", "prefill0", "decode1", True),
    ("adaptive", "prefill0", "prefill1", True),          # adaptive decode units prefill too
    ("adaptive", "decode0", "decode1", False), ("colocated", None, "colocated1", True),
    ("colocated", "colocated0", "colocated1", False)])
def test_a_failure_stays_local_while_the_units_left_serve_every_phase_of_the_mode(mode, retired, failing, alone):
    coordinator = fake_units(mode)
    by_name = {a.unit_name: a for a in coordinator.actors}
    if retired is not None:
        coordinator.retire(by_name[retired], by_name[retired], "gone")
    assert coordinator.serves_without(by_name[failing]) is alone
    assert coordinator.serves_without() is True
    assert [state for _, _, state, _ in coordinator.units()].count("retired") == (retired is not None)


def test_a_preempted_sequence_waits_for_a_prefill_unit_and_aborts_skip_retired_units():
    def actor(name: str, index: int) -> SimpleNamespace:
        mail: list = []
        return SimpleNamespace(unit_name=name, name=name, index=index, alive=True, routed_prefill=0, mail=mail,
                               send=mail.append)

    prefill, decode = actor("prefill", 0), [actor(f"decode{i}", i) for i in (0, 1)]
    coordinator = Coordinator([prefill], decode, "prefill", True)
    request = Request("r", (5, 6, 7), GREEDY)
    coordinator.table["r"] = Route(decode=0)
    coordinator.fail_unit(prefill, "broken")
    coordinator.post(Preempted(request, (9,)))
    assert prefill.mail == [] and coordinator.table["r"] == Route()         # parked: no prefill unit is up
    fresh = actor("prefill", 0)
    coordinator.unit_up(prefill, fresh)
    assert fresh.mail == [Preempted(request, (9,))] and coordinator.table["r"] == Route(prefill=0)
    coordinator.retire(decode[1], decode[1], "gone")
    coordinator.abort("unknown")                         # not in the table: every unit but the retired one
    assert [m for m in fresh.mail if isinstance(m, Abort)] == [Abort("unknown")]
    assert decode[0].mail == [Abort("unknown")] and decode[1].mail == []
