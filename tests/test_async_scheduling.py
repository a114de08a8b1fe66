"""Async scheduling (a step scheduled while the previous one runs) changes nothing a client sees.

Every mode, with and without overlap: greedy and seeded sampling, penalties, stop strings,
logprobs and min_tokens, sequences joining and leaving every step, preemption under a tight
pool, and aborts at random moments that must leave both pools free.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from tests.models import demo_checkpoint, engine_config
from tests.test_engine_modes import assert_pools_free, prompts, run_engine, wait_idle

MODES = ("disaggregated", "colocated")


def mixed_params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True),
        dict(temperature=0.7, top_k=20, seed=7, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
        dict(temperature=0.0, presence_penalty=1.5, logprobs=3, ignore_eos=True),
        dict(temperature=1.0, min_p=0.05, seed=9 + i, min_tokens=6, logprobs=0),
        dict(temperature=0.0, stop=("e", " t"), ignore_eos=True),
    ]
    return SamplingParams(max_tokens=6 + (i * 7) % 23, **kinds[i % len(kinds)])


def requests(n: int, seed: int = 0) -> list[Request]:
    lengths = [3 + (i * 37) % 150 for i in range(n)]
    return [Request(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(lengths, seed))]


async def joining_every_step(engine: Engine, reqs: list[Request]) -> dict[str, tuple]:
    """Submit one request per decode step (as tokens arrive), then collect everything."""
    results: dict[str, tuple] = {}

    async def consume(request: Request) -> None:
        tokens, text, logprobs, reason = [], [], [], None
        async for event in engine.submit(request):
            tokens += event.token_ids
            text.append(event.text)
            logprobs += [(lp.token_id, tuple(t for t, _ in lp.top), lp.logprob) for lp in event.logprobs]
            reason = event.finish_reason
            arrived.set()
        results[request.request_id] = (tuple(tokens), "".join(text), tuple(logprobs), reason)

    arrived = asyncio.Event()
    tasks = []
    for request in reqs:
        tasks.append(asyncio.ensure_future(consume(request)))
        arrived.clear()
        await arrived.wait()
    await asyncio.gather(*tasks)
    return results


def without_logprob_values(outputs: dict) -> dict:
    return {r: (tokens, text, tuple(lp[:2] for lp in logprobs), reason)
            for r, (tokens, text, logprobs, reason) in outputs.items()}


def run(mode: str, overlap: bool, reqs: list[Request], **overrides) -> tuple[dict, Engine]:
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, async_scheduling=overlap, **overrides))
    outputs = asyncio.run(run_engine(engine, joining_every_step(engine, reqs)))
    assert_pools_free(engine)
    return outputs, engine


def test_outputs_identical_with_and_without_overlap_in_every_mode():
    reqs = requests(18)
    outputs = {}
    for mode in MODES:
        for overlap in (False, True):
            outputs[mode, overlap], engine = run(mode, overlap, reqs, max_prefill_tokens=64)
            engine.close()
    reference = outputs["colocated", False]
    for key, got in outputs.items():
        assert without_logprob_values(got) == without_logprob_values(reference), key
        for request_id, (*_, logprobs, _reason) in got.items():    # batch shapes differ: float noise only
            expected = reference[request_id][2]
            assert [lp[2] for lp in logprobs] == pytest.approx([lp[2] for lp in expected], abs=1e-4), key
    assert any(lps for _, _, lps, _ in reference.values())
    assert any(reason.value == "stop" for *_, reason in reference.values())


@pytest.mark.parametrize("mode", MODES)
def test_preemption_under_a_tight_pool_gives_the_roomy_outputs(mode):
    reqs = [Request(f"p{i}", p, SamplingParams(max_tokens=100, temperature=0.8, top_k=50, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts([40] * 8, seed=4))]
    roomy, engine = run(mode, False, reqs, max_model_len=256)
    engine.close()
    tight, engine = run(mode, True, reqs, max_model_len=256, kv_cache_memory="1MiB")
    decode = engine.actors[-1]
    preemptions = (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions
    engine.close()
    assert preemptions > 0
    assert tight == roomy


@pytest.mark.parametrize("mode", MODES)
def test_random_aborts_with_overlap_leave_both_pools_free(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, async_scheduling=True, max_prefill_tokens=48))
    rng = random.Random(5)

    async def scenario():
        streams = [engine.submit(r) for r in requests(24, seed=9)]

        async def consume(stream, abort_after: int):
            seen = 0
            async for _ in stream:
                seen += 1
                if seen >= abort_after:
                    await stream.aclose()
                    return

        await asyncio.gather(*(consume(s, rng.randrange(1, 12)) for s in streams))
        await wait_idle(engine)

    asyncio.run(run_engine(engine, scenario()))
    assert_pools_free(engine)
    engine.close()
