"""What a step costs outside the model: the engine's host work, and the process boundary of worker processes.

    python experiments/step_overhead.py host --num-seqs 1,32,128,256 [--steps 200] [--async-scheduling]
    python experiments/step_overhead.py boundary --num-seqs 1,32,128

host: the colocated engine on the base demo model (its BPE tokenizer detokenizes real text) with N
sequences decoding, the forward replaced by a no-op of the right shapes (hidden states of zeros, logits
from a table of random rows): microseconds per step, in total and per phase (schedule, prepare, sample,
post-process, detokenize).

boundary: N decode rows (and N new rows of a 64-token prompt each, the heaviest message) sent to an echo
worker process over the engine's own pipe and wire format, which builds an outcome of N tokens and sends
it back: per step, the encode/decode work alone, the pipe round trip, and a thread round trip
(`run_in_executor`: what `--workers thread` pays) in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections import defaultdict

import orjson
import torch

from pdserve.bench.documents import machine_description
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.llm import new_event_loop
from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.step import NewRow, StepInput, StepResult, StepWork
from pdserve.engine.worker.step_runner import StepOutcome


# host

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
    runner.model.decode_logits = lambda batch, kv_pool: None      # NOTE: else the one native call runs the model


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


def run_host(args) -> None:
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


# boundary

def decode_work(n: int) -> StepWork:
    return StepWork(StepInput(decode_rows=tuple(range(n)), decode_positions=tuple(range(100, 100 + n))))


def prefill_work(n: int) -> StepWork:
    rows = tuple(NewRow(i, tuple(range(64)), 64, tuple(range(i * 4, i * 4 + 4)), SamplingParams()) for i in range(n))
    return StepWork(StepInput(new_rows=rows))


def outcome_for(work: StepWork) -> StepOutcome:
    n = len(work.step.decode_rows) + len(work.step.new_rows)
    return StepOutcome(StepResult(tuple(range(n))), (), 0.0, 1)


def echo(conn) -> None:
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(wire.encode_outcome(outcome_for(wire.decode_work(data))))


def codec_us(work: StepWork, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        wire.decode_work(wire.encode_work(work))
        wire.decode_outcome(wire.encode_outcome(outcome_for(work)))
    return (time.perf_counter() - started) / repeats * 1e6


async def pipe_us(conn, work: StepWork, repeats: int) -> float:
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: replies.put_nowait(wire.decode_outcome(conn.recv_bytes())))
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            conn.send_bytes(wire.encode_work(work))
            await replies.get()
        return (time.perf_counter() - started) / repeats * 1e6
    finally:
        loop.remove_reader(conn.fileno())


async def thread_us(work: StepWork, repeats: int) -> float:
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    for _ in range(repeats):
        await loop.run_in_executor(None, outcome_for, work)
    return (time.perf_counter() - started) / repeats * 1e6


def boundary_rows(args, parent, loop) -> list[dict]:
    rows = []
    for n in (int(x) for x in args.num_seqs.split(",")):
        for kind, work in (("decode rows", decode_work(n)), ("new 64-token rows", prefill_work(n))):
            repeats = max(args.repeats // (8 if kind != "decode rows" else 1), 50)
            loop.run_until_complete(pipe_us(parent, work, 50))                 # warm both sides
            rows.append({"num_seqs": n, "kind": kind, "bytes": len(wire.encode_work(work)),
                         "codec_us": codec_us(work, repeats),
                         "pipe_round_trip_us": loop.run_until_complete(pipe_us(parent, work, repeats)),
                         "thread_round_trip_us": loop.run_until_complete(thread_us(work, repeats))})
    return rows


def run_boundary(args) -> None:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=True)
    worker = context.Process(target=echo, args=(child,), daemon=True)
    worker.start()
    loop = new_event_loop()
    try:
        rows = boundary_rows(args, parent, loop)
    finally:
        parent.send_bytes(b"")
        worker.join(5)
        loop.close()
    print(machine_description())
    print("| rows | message | bytes | encode+decode (both ways) us | pipe round trip us | thread round trip us |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['num_seqs']} | {r['kind']} | {r['bytes']} | {r['codec_us']:.1f} | {r['pipe_round_trip_us']:.1f} "
              f"| {r['thread_round_trip_us']:.1f} |")
    if args.result_json:
        with open(args.result_json, "wb") as f:
            f.write(orjson.dumps({"machine": machine_description(), "rows": rows}, option=orjson.OPT_INDENT_2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    p = probes.add_parser("host", help="the engine's host work per step, with a null model")
    p.add_argument("--model", default="demo:base")
    p.add_argument("--num-seqs", default="1,32,128,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--result-json", default=None)
    p.set_defaults(run=run_host)
    p = probes.add_parser("boundary", help="a step message's round trip to a worker process")
    p.add_argument("--num-seqs", default="1,32,128")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--result-json", default=None)
    p.set_defaults(run=run_boundary)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
