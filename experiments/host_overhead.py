"""Host time per decode step with a null model: schedule + prepare + sample + post-process + detokenize.

    python experiments/host_overhead.py --num-seqs 1,32,128,256

The model's forward is replaced by a no-op of the right shapes (hidden states of zeros, logits
from a table of random rows), so what is left of a step is the engine's own host work. Runs the
colocated engine on the base demo model (its BPE tokenizer detokenizes real text) with N
sequences decoding, and reports microseconds per step, in total and per phase. JSON to --result-json.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict

import orjson
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.llm import new_event_loop

LOGIT_ROWS = 4096


class PhaseTimer:
    """Wall time spent inside wrapped callables, per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.seconds.clear()


def null_model(runner, vocab: int, seed: int = 0) -> None:
    """Replace the forward with a no-op of the right shapes; logits rotate through random rows."""
    table = torch.randn(LOGIT_ROWS, vocab, generator=torch.Generator().manual_seed(seed))
    hidden = runner.model.config.hidden_size
    cursor = [0]

    def forward(batch, kv_pool):
        return torch.zeros(batch.input_ids.shape[0], hidden, dtype=runner.dtype)

    def compute_logits(rows):
        start = cursor[0]
        cursor[0] = (start + rows.shape[0]) % (LOGIT_ROWS - rows.shape[0])
        return table[start:start + rows.shape[0]]

    runner.model.forward = forward
    runner.model.compute_logits = compute_logits


def instrument(engine: Engine, timer: PhaseTimer) -> None:
    actor = engine.actors[-1]
    timer.wrap(actor, "schedule", "schedule")
    timer.wrap(actor, "prepare", "prepare")                  # StepInput on the loop
    timer.wrap(actor.runner, "prepare", "prepare")           # buffers on the compute thread
    timer.wrap(actor.runner.sampling, "batch", "sample")
    timer.wrap(actor.runner.sampler, "sample", "sample")
    timer.wrap(actor, "record", "postprocess")
    timer.wrap(actor, "emit", "detokenize")                  # the engine front: text, stop strings, streams


async def measure(engine: Engine, num_seqs: int, steps: int, timer: PhaseTimer) -> dict:
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    streams = [engine.submit(Request(f"r{i}", tuple(range(100 + i, 116 + i)), params)) for i in range(num_seqs)]
    consumers = [asyncio.ensure_future(_consume(s)) for s in streams]
    actor = engine.actors[-1]
    while actor.queue_lengths()[0] < num_seqs:
        await asyncio.sleep(0.01)
    await _steps(actor, 20)                                  # warm-up
    timer.reset()
    first, start = actor.steps, time.perf_counter()
    await _steps(actor, steps)
    wall = time.perf_counter() - start
    done = actor.steps - first
    for stream in streams:
        await stream.aclose()
    await asyncio.gather(*consumers, return_exceptions=True)
    per_step = {phase: seconds / done * 1e6 for phase, seconds in timer.seconds.items()}
    return {"num_seqs": num_seqs, "steps": done, "step_us": wall / done * 1e6, **{f"{k}_us": v for k, v in per_step.items()}}


async def _consume(stream) -> None:
    async for _ in stream:
        pass


async def _steps(actor, n: int) -> None:
    target = actor.steps + n
    while actor.steps < target:
        await asyncio.sleep(0.001)


def run_one(args, num_seqs: int) -> dict:
    config = EngineConfig(model=args.model, dtype="float32", mode="colocated", cuda_graph=False,
                          async_scheduling=args.async_scheduling,
                          cache=CacheConfig(kv_cache_memory="512MiB"),
                          scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_model_len=4096))
    engine = Engine(config)
    null_model(engine.actors[-1].runner, engine.model_config.vocab_size)
    timer = PhaseTimer()
    instrument(engine, timer)
    loop = new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        result = loop.run_until_complete(measure(engine, num_seqs, args.steps, timer))
        loop.run_until_complete(engine.stop())
    finally:
        loop.close()
        engine.close()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--num-seqs", default="1,32,128,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = [run_one(args, int(n)) for n in args.num_seqs.split(",")]
    print(f"async scheduling {'on' if args.async_scheduling else 'off'}; phases in us per step")
    phases = sorted({k for r in results for k in r if k.endswith("_us") and k != "step_us"})
    print("seqs  step_us  " + "  ".join(phases))
    for r in results:
        print(f"{r['num_seqs']:>4}  {r['step_us']:>7.0f}  " + "  ".join(f"{r.get(k, 0):>{len(k)}.0f}" for k in phases))
    if args.result_json:
        with open(args.result_json, "wb") as f:
            f.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
