"""PDSERVE_STEP_TRACE: every finished step of every unit, one JSON line each, counting the work it did."""
from __future__ import annotations

import asyncio

import orjson

from pdserve import env
from pdserve.engine.actors.step_trace import StepTrace
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from tests.models import demo_checkpoint, engine_config
from tests.test_engine_modes import collect, prompts, run_engine

NEW_TOKENS = 12


async def serve(engine: Engine, requests: list[Request]) -> list[list[int]]:
    return [tokens for tokens, _ in await asyncio.gather(*(collect(engine.submit(r)) for r in requests))]


def test_the_trace_holds_every_step_and_the_work_it_did(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(env.STEP_TRACE, str(path))
    lengths = [40, 7, 23]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [Request(f"t{i}", p, params) for i, p in enumerate(prompts(lengths))]
    engine = Engine(engine_config(demo_checkpoint(), mode="disaggregated", max_prefill_tokens=16))
    outputs = asyncio.run(run_engine(engine, serve(engine, requests)))
    engine.close()
    assert [len(tokens) for tokens in outputs] == [NEW_TOKENS] * len(lengths)
    steps = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    by_unit = {unit: [s for s in steps if s["unit"] == unit] for unit in {s["unit"] for s in steps}}
    prefill = [s for s in steps if s["prefill_tokens"]]
    assert {s["unit"] for s in prefill} == {"prefill"} and len(by_unit) == 2
    assert sum(s["prefill_tokens"] for s in prefill) == sum(lengths)          # every prompt token, once
    assert sum(s["decode_rows"] for s in steps) == len(lengths) * (NEW_TOKENS - 1)   # the first token: prefill's
    # the counts a step's cost is fitted to: a prompt's chunks read n(n+1)/2 pairs in all, however it was cut; a
    # decode row at position p reads p + 1 tokens (positions n .. n + NEW_TOKENS - 2 for a prompt of n)
    assert sum(s["prefill_pairs"] for s in steps) == sum(n * (n + 1) // 2 for n in lengths)
    assert all((s["prompt_chunks"] > 0) == (s["prefill_tokens"] > 0) for s in steps)
    assert sum(s["decode_context"] for s in steps) == sum(p + 1 for n in lengths for p in range(n, n + NEW_TOKENS - 1))
    for unit_steps in by_unit.values():
        assert [s["step"] for s in unit_steps] == sorted(s["step"] for s in unit_steps)
        assert all(s["launched"] <= s["done"] and s["seconds"] > 0 for s in unit_steps)


def test_without_the_variable_nothing_is_traced(monkeypatch):
    monkeypatch.delenv(env.STEP_TRACE, raising=False)
    assert StepTrace.from_environment() is None
