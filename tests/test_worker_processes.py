"""`--workers process`: the same greedy tokens as thread workers and transformers in every mode; a
worker killed mid-step or whose step raises ends its requests with errors, leaks no block, leaves
no shared-memory segment or orphan process, and the engine serves again (or is dead, as configured)."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.engine import Engine
from pdserve.engine.worker.processes.process import ProcessCompute
from tests.models import demo_checkpoint, engine_config
from tests.test_engine_modes import assert_pools_free, collect, prompts, run_engine, transformers_model  # noqa: F401
from tests.test_supervisor import LONG, SHORT, assert_failed_then_served, build, reference_tokens, until

MODES = ("adaptive", "disaggregated", "colocated")
GREEDY_PROMPTS = prompts([5, 90, 30, 200], seed=3)


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def worker_pids(engine: Engine) -> list[int]:
    return [unit.pid for unit in engine.units.all() if isinstance(unit, ProcessCompute)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def greedy(engine: Engine) -> list[list[int]]:
    results = await asyncio.gather(*(collect(engine.submit(Request(f"g{i}", p, SHORT)))
                                     for i, p in enumerate(GREEDY_PROMPTS)))
    return [tokens for tokens, _ in results]


@pytest.mark.parametrize("mode", MODES)
def test_process_workers_give_the_thread_workers_and_transformers_tokens(mode, transformers_model):  # noqa: F811
    before = dev_shm()
    engines = {w: Engine(engine_config(demo_checkpoint(), mode=mode, workers=w)) for w in ("thread", "process")}
    outputs = {w: asyncio.run(run_engine(e, greedy(e))) for w, e in engines.items()}
    assert outputs["process"] == outputs["thread"]
    for prompt, tokens in zip(GREEDY_PROMPTS, outputs["process"]):
        ids = torch.tensor([prompt])
        expected = transformers_model.generate(ids, max_new_tokens=len(tokens), do_sample=False,
                                               min_new_tokens=len(tokens))[0, len(prompt):].tolist()
        assert tokens == expected
    pids = worker_pids(engines["process"])
    assert len(pids) == (1 if mode == "colocated" else 2)
    for engine in engines.values():
        assert_pools_free(engine)
        engine.close()
    assert all(gone(pid) for pid in pids) and dev_shm() <= before


@pytest.mark.parametrize("mode", ["adaptive", "colocated"])
def test_a_worker_killed_mid_step_errors_its_requests_and_is_spawned_again(mode, monkeypatch):
    before = dev_shm()
    unit_name = "colocated" if mode == "colocated" else "decode"
    engine = build(mode, monkeypatch, f"{unit_name}:hang@3", workers="process")
    victim = next(u for u in engine.units.all() if u.spec.name == unit_name)
    first_pid = victim.pid

    async def scenario():
        streams = [engine.submit(Request(f"doomed{i}", p, LONG)) for i, p in enumerate(prompts([6, 40], seed=1))]
        waiting = asyncio.gather(*(collect(s) for s in streams))
        await until(lambda: engine.actors[-1].step_started_at is not None and engine.actors[-1].steps >= 2)
        await asyncio.sleep(0.2)                        # the third step hangs in the worker
        os.kill(first_pid, signal.SIGKILL)
        results = await asyncio.wait_for(waiting, 30)
        await until(lambda: engine.healthy(), 60)
        after = await asyncio.wait_for(collect(engine.submit(Request("after", prompts([10], seed=2)[0], SHORT))), 60)
        return results, after

    results, (tokens, reason) = asyncio.run(run_engine(engine, scenario()))
    assert all(r is FinishReason.ERROR for _, r in results)
    assert reason is FinishReason.LENGTH and len(tokens) == SHORT.max_tokens
    assert victim.pid != first_pid and gone(first_pid) and engine.supervisor.restarts == 1
    assert_pools_free(engine)
    pids = worker_pids(engine)
    engine.close()
    assert all(gone(pid) for pid in pids) and dev_shm() <= before


def test_a_raising_worker_step_restarts_and_serves_the_thread_workers_tokens(monkeypatch):
    expected = reference_tokens("disaggregated")                     # thread workers
    assert_failed_then_served(build("disaggregated", monkeypatch, "prefill:raise@1", workers="process"), expected)


def test_a_worker_stuck_past_the_step_timeout_is_killed_and_spawned_again(monkeypatch):
    engine = build("colocated", monkeypatch, "colocated:hang@2", workers="process", step_timeout=1.0)
    first_pid = worker_pids(engine)[0]

    async def scenario():
        _, reason = await asyncio.wait_for(collect(engine.submit(Request("r", prompts([8])[0], LONG))), 30)
        await until(lambda: engine.healthy(), 60)
        return reason, await asyncio.wait_for(collect(engine.submit(Request("s", prompts([8])[0], SHORT))), 60)

    reason, (tokens, after) = asyncio.run(run_engine(engine, scenario()))
    assert reason is FinishReason.ERROR and after is FinishReason.LENGTH and engine.dead is None
    assert gone(first_pid) and worker_pids(engine)[0] != first_pid
    engine.close()


def test_a_worker_that_cannot_start_fails_the_engine_with_its_reason(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in demo_checkpoint().iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="worker could not start"):
        Engine(engine_config(broken, mode="colocated", workers="process"))


def test_process_workers_refuse_cuda_without_cuda_with_a_reason(monkeypatch):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.units.processes import load_process_units
    from tests.models import layout_of

    from pdserve.engine.transfer.cuda_ipc import CudaIpcUnavailable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = EngineConfig(workers="process")
    layout = layout_of(config, ModelConfig.from_dir(demo_checkpoint()), "disaggregated", "cuda:0", "cuda:1",
                       torch.float16)
    with pytest.raises(CudaIpcUnavailable, match="cuda:0 shares its KV pools through CUDA IPC, and CUDA is not"):
        load_process_units(config, None, layout, frozenset())
