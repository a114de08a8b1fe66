"""An actor failure seen from HTTP: the request in flight gets an OpenAI error, then either the
server serves again (restart: /health 200) or /health and new requests get 503 and the process
exits non-zero with the watchdog silent (exit), so systemd restarts it."""
from __future__ import annotations

import os
import signal
from dataclasses import replace

import aiohttp
import openai
import orjson

from pdserve.engine.engine import Engine
from tests.models import SLO_FLAGS, SLOS_SET
from pdserve.engine.worker import faults
from tests.test_server_api import client, engine_config, serve  # noqa: F401  (fixtures)
from tests.test_server_shutdown import server_process, stream_body  # noqa: F401  (fixtures)


async def test_after_a_restart_the_server_is_healthy_and_answers(serve, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(faults.ENV, "decode:raise@3")
    config = engine_config(tiny_model_dir, "disaggregated")
    engine = Engine(replace(config, scheduler=replace(config.scheduler, **SLOS_SET)))
    monkeypatch.delenv(faults.ENV)
    base = await serve(engine)
    async with client(base) as c:
        try:
            await c.completions.create(model=tiny_model_dir.name, prompt="a long story", max_tokens=200)
            raise AssertionError("the failed request did not error")
        except openai.InternalServerError as e:
            assert "decode actor failed" in e.message
        while not engine.healthy():
            async with aiohttp.ClientSession() as session, session.get(base + "/health") as health:
                assert health.status == 503
        again = await c.completions.create(model=tiny_model_dir.name, prompt="a short one", max_tokens=4)
    assert again.choices[0].finish_reason == "length"
    async with aiohttp.ClientSession() as session, session.get(base + "/health") as health:
        assert health.status == 200
    engine.close()


async def test_a_dead_engine_fails_the_stream_refuses_the_rest_and_exits_1(server_process, tiny_model_dir,
                                                                           monkeypatch):
    monkeypatch.setenv(faults.ENV, "decode:raise@3")
    server = server_process("--on-worker-failure", "exit", "--mode", "disaggregated", *SLO_FLAGS)
    notes: list[bytes] = []
    await server.wait_for(b"READY=1", notes)
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base + "/v1/completions", json=stream_body(tiny_model_dir.name)) as stream:
            raw = await stream.read()
        events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
        assert "decode actor failed" in events[-1]["error"]["message"]
        try:
            async with session.get(server.base + "/health") as health:
                assert health.status == 503 and "dead" in (await health.json())["error"]["message"]
        except aiohttp.ClientConnectionError:
            pass                                              # already gone
    assert server.exit_code() == 1, server.log.read_text()
    log = server.log.read_text()
    assert "the engine is dead, exiting" in log


def children(pid: int) -> set[int]:
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found |= {int(c) for c in f.read().split()}
    return found


async def test_sigterm_with_worker_processes_exits_0_and_leaves_nothing_behind(server_process, tiny_model_dir):
    shm_before = set(os.listdir("/dev/shm"))
    server = server_process("--workers", "process", "--mode", "disaggregated")
    await server.wait_for(b"READY=1")
    workers = children(server.proc.pid)
    assert len(workers) >= 2                            # the prefill and decode workers (and a resource tracker)
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base + "/v1/completions",
                                json={"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 4}) as reply:
            assert reply.status == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_code() == 0, server.log.read_text()
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert set(os.listdir("/dev/shm")) <= shm_before
