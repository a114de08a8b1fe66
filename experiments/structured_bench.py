"""Structured outputs' cost: decode tok/s of JSON-schema-constrained vs unconstrained requests at batch 1 and
32, and the first-token delay of a schema seen for the first time vs a cached one, in one process.

    python experiments/structured_bench.py --batches 1,32 --max-tokens 128 --mode colocated

Both request kinds produce exactly `--max-tokens` tokens: unconstrained ones ignore EOS, constrained ones
follow a schema (an array of at least 1000 objects) that cannot end sooner, so tok/s compare like for
like; each batch size is first run briefly with both kinds (the first steps at a new shape are much slower),
and each run also reports the process's CPU time per token. The first-token delays go through the server's grammar compiler (build + check, cached by spec) and
the engine (the runner compiles its matcher on first sight), each schema new by a unique property name.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
import uuid

import orjson

from pdserve.bench.documents import machine_description
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.llm import new_event_loop
from pdserve.engine.text.grammar import grammar_tokenizer
from pdserve.server.structured import GrammarCompiler, OutputFormat

WARM_UP_TOKENS = 16
PROMPT = "List some records of people as JSON."
ENDLESS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "role": {"enum": ["admin", "user", "guest"]}}}}


def schema_format(schema: dict) -> OutputFormat:
    return OutputFormat("json", orjson.dumps(schema).decode(), "bench")


async def run_batch(engine: Engine, prompt: tuple[int, ...], params: SamplingParams,
                    batch: int) -> tuple[int, float, float]:
    """(output tokens, seconds, CPU seconds of this process) of `batch` requests submitted together."""
    async def one(i: int) -> int:
        tokens = 0
        async for event in engine.submit(Request(f"bench-{uuid.uuid4().hex}", prompt, params)):
            tokens += len(event.token_ids)
        return tokens

    started, cpu_started = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    return sum(counts), time.perf_counter() - started, time.process_time() - cpu_started


async def first_token_seconds(engine: Engine, compiler: GrammarCompiler, prompt: tuple[int, ...],
                              schema: dict) -> float:
    started = time.perf_counter()
    grammar = await compiler.grammar(schema_format(schema))
    params = SamplingParams(max_tokens=1, temperature=0.0, grammar=grammar)
    async for event in engine.submit(Request(f"ttft-{uuid.uuid4().hex}", prompt, params)):
        if event.token_ids:
            return time.perf_counter() - started
    raise RuntimeError("no first token")


async def measure(engine: Engine, args: argparse.Namespace) -> dict:
    await engine.start()
    try:
        vocab = engine.model_config.vocab_size
        eos = tuple(sorted(t for t in engine.eos_token_ids if t < vocab))
        compiler = GrammarCompiler(lambda: grammar_tokenizer(engine.model_dir, vocab, eos), lambda seconds: None)
        prompt = tuple(engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}]))
        grammar = await compiler.grammar(schema_format(ENDLESS))
        kinds = {"unconstrained": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                 "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, grammar=grammar)}
        rows = []
        for batch in args.batches:
            for params in kinds.values():          # warm up: the first steps of a batch size build its kernels
                await run_batch(engine, prompt, dataclasses.replace(params, max_tokens=WARM_UP_TOKENS), batch)
            for kind, params in kinds.items():
                tokens, seconds, cpu_seconds = await run_batch(engine, prompt, params, batch)
                rows.append({"batch": batch, "kind": kind, "tokens": tokens, "seconds": seconds,
                             "tok_per_s": tokens / seconds, "cpu_ms_per_token": cpu_seconds / tokens * 1e3})
        delays = {"new": [], "cached": []}
        for i in range(args.schemas):
            schema = {"type": "object", "required": [f"field_{uuid.uuid4().hex[:8]}"],
                      "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
            delays["new"].append(await first_token_seconds(engine, compiler, prompt, schema))
            delays["cached"].append(await first_token_seconds(engine, compiler, prompt, schema))
        return {"rows": rows, "first_token_seconds": delays}
    finally:
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated", "adaptive"))
    parser.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--schemas", type=int, default=5, help="new schemas timed (each then again, cached)")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, mode=args.mode, cache=CacheConfig(kv_cache_memory="1GiB"),
                                 scheduler=SchedulerConfig(max_model_len=1024)))
    loop = new_event_loop()
    try:
        result = loop.run_until_complete(measure(engine, args))
    finally:
        loop.close()
        engine.close()
    machine = machine_description()
    print(machine)
    print("| batch | requests | tokens | tok/s | CPU ms / token |")
    print("|---:|---|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['batch']} | {r['kind']} | {r['tokens']} | {r['tok_per_s']:.1f} | {r['cpu_ms_per_token']:.2f} |")
    by = {(r["batch"], r["kind"]): r["tok_per_s"] for r in result["rows"]}
    ratios = ", ".join(f"batch {b}: {by[b, 'json_schema'] / by[b, 'unconstrained']:.3f}" for b in args.batches)
    delays = result["first_token_seconds"]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"structured/unconstrained tok/s: {ratios}; first token, new schema {median(delays['new']) * 1e3:.1f} ms, "
          f"cached {median(delays['cached']) * 1e3:.1f} ms (medians of {args.schemas})")
    if args.result_json:
        with open(args.result_json, "wb") as f:
            f.write(orjson.dumps({"machine": machine, "args": vars(args), **result}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
