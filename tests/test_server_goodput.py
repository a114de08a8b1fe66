"""Goodput in /metrics: each finished request judged server-side against the engine's TTFT and ITL SLOs,
through a real server and the official client; the SLOs in effect exported beside the counters."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.engine.coordinator.slo import Slos
from pdserve.engine.engine import Engine
from pdserve.server.metrics import Metrics
from tests.test_server_api import client, engine_config, scrape, serve, wait_until_idle  # noqa: F401  (fixtures)

LOOSE, TIGHT = 60_000.0, 1e-6          # ms: every request meets it / no interval of two tokens can


def slo_engine(model_dir, ttft_ms: float, itl_ms: float, mode: str = "colocated") -> Engine:
    config = engine_config(model_dir, mode)
    return Engine(replace(config, scheduler=replace(config.scheduler, ttft_slo_ms=ttft_ms, itl_slo_ms=itl_ms)))


def met(samples: dict, slo: str) -> float:
    return samples[("pdserve_requests_slo_met_total", (("slo", slo),))]


async def completions(base: str, model: str, max_tokens: list[int]) -> None:
    async with client(base) as c:
        for n in max_tokens:
            answer = await c.completions.create(model=model, prompt="tell me", max_tokens=n,
                                                extra_body={"ignore_eos": True})
            assert answer.usage.completion_tokens == n


@pytest.mark.parametrize("ttft_ms,itl_ms,expected", [
    (LOOSE, LOOSE, {"ttft": 3, "itl": 3, "both": 3}),
    (LOOSE, TIGHT, {"ttft": 3, "itl": 1, "both": 1}),        # only the one-token answer has no interval
    (TIGHT, LOOSE, {"ttft": 0, "itl": 3, "both": 0}),
])
async def test_finished_requests_are_counted_against_both_slos(serve, tiny_model_dir, ttft_ms, itl_ms, expected):
    engine = slo_engine(tiny_model_dir, ttft_ms, itl_ms)
    base = await serve(engine)
    await completions(base, tiny_model_dir.name, [6, 1, 9])
    samples = await wait_until_idle(base)
    assert samples[("pdserve_requests_slo_checked_total", ())] == 3
    assert {slo: met(samples, slo) for slo in expected} == expected
    assert samples[("pdserve_slo_seconds", (("slo", "ttft"),))] == pytest.approx(ttft_ms / 1e3)
    assert samples[("pdserve_slo_seconds", (("slo", "itl"),))] == pytest.approx(itl_ms / 1e3)
    engine.close()


async def test_an_aborted_request_is_not_judged(serve, tiny_model_dir):
    engine = slo_engine(tiny_model_dir, LOOSE, LOOSE)
    base = await serve(engine)
    async with client(base) as c:
        stream = await c.completions.create(model=tiny_model_dir.name, prompt="a long one", max_tokens=200,
                                            stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()                              # the client leaves: the request is aborted
    await completions(base, tiny_model_dir.name, [4])
    samples = await wait_until_idle(base)
    assert samples[("pdserve_requests_finished_total", (("finish_reason", "abort"),))] == 1
    assert samples[("pdserve_requests_slo_checked_total", ())] == 1 and met(samples, "both") == 1
    engine.close()


async def test_derived_slos_are_the_engines_and_are_exported(serve, tiny_model_dir):
    engine = Engine(engine_config(tiny_model_dir, "adaptive"))
    base = await serve(engine)
    slos = engine.slos
    assert slos is not None and slos.ttft > 0 and slos.itl > 0
    assert "decode step of" in slos.itl_source and "first token of a typical" in slos.ttft_source
    await completions(base, tiny_model_dir.name, [3])
    samples = await wait_until_idle(base)
    assert samples[("pdserve_slo_seconds", (("slo", "ttft"),))] == pytest.approx(slos.ttft)
    assert samples[("pdserve_slo_seconds", (("slo", "itl"),))] == pytest.approx(slos.itl)
    assert samples[("pdserve_requests_slo_checked_total", ())] == 1
    engine.close()


def test_a_derived_ttft_slo_judges_each_request_at_its_prompts_length():
    metrics = Metrics(lambda: None, lambda: [])
    slos = Slos(ttft=1.0, itl=0.05, ttft_source="derived", ttft_tokens=100)
    for prompt_tokens in (100, 400):                       # bounds 1 s and 4 s: a 3 s first token meets the second
        metrics.observe_slos(slos, "length", prompt_tokens, 3.0, 0.01)
    value = metrics.registry.get_sample_value
    assert value("pdserve_requests_slo_checked_total") == 2
    assert value("pdserve_requests_slo_met_total", {"slo": "ttft"}) == 1
    assert value("pdserve_requests_slo_met_total", {"slo": "both"}) == 1
