"""What structured outputs cost: decode with a JSON schema against without, and the grammar mask alone.

    python experiments/structured.py decode --batches 1,32 --max-tokens 128 --mode colocated
    python experiments/structured.py mask --rows 32 --steps 128

decode: tok/s of JSON-schema-constrained against unconstrained requests at each batch size, and the
first-token delay of a schema seen for the first time against a cached one, in one process. Both kinds
produce exactly `--max-tokens` tokens (unconstrained ones ignore EOS; the schema, an array of at least
1000 objects, cannot end sooner); each batch size first runs briefly with both kinds (the first steps at a
new shape are slower), and each run reports the process's CPU time per token. The first-token delays go
through the server's grammar compiler (cached by spec) and the engine, each schema new by a unique name.

mask: CPU time of one decode step's grammar-mask path without a model: `--rows` rows of the same schema's
matcher for `--steps` steps of fill (llguidance) -> apply (the bitmask onto fp32 logits) -> greedy argmax
-> advance, on seeded random logits. Each phase is timed by `time.process_time` (the whole process's CPU
time, every thread), so the figures mean something on a busy machine too; torch runs `--threads` threads.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import time
import uuid

import orjson
import torch

from pdserve.bench.documents import machine_description
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.llm import new_event_loop
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.text.grammar import grammar_tokenizer, json_schema_grammar
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.worker.sampling.constraints import RowConstraints
from pdserve.server.structured import GrammarCompiler, OutputFormat


# decode

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


def run_decode(args) -> None:
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
            f.write(orjson.dumps({"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "run"},
                                 **result}, option=orjson.OPT_INDENT_2))


# mask

def measure_mask(args: argparse.Namespace) -> dict:
    model = resolve_model(args.model)
    config = ModelConfig.from_dir(model.path)
    eos = Tokenizer.from_dir(model.path).eos_token_ids | frozenset(config.eos_token_ids)
    constraints = RowConstraints(model.path, config.vocab_size, eos)
    params = SamplingParams(max_tokens=args.steps, temperature=0.0, grammar=json_schema_grammar(ENDLESS))
    rows = list(range(args.rows))
    for row in rows:
        constraints.add(row, params, ())
    constraints.constraints(rows)                  # builds the tokenizer and the matchers: not timed
    generator = torch.Generator().manual_seed(0)
    seconds = {"fill": 0.0, "apply": 0.0, "argmax": 0.0, "advance": 0.0}
    tokens_seen = []
    for _ in range(args.steps):
        logits = torch.randn(args.rows, config.vocab_size, generator=generator)
        started = time.process_time()
        step = constraints.constraints(rows)
        filled = time.process_time()
        step.to(logits.device).apply(logits)
        applied = time.process_time()
        tokens = logits.argmax(dim=-1).tolist()
        sampled = time.process_time()
        constraints.advance(rows, tokens)
        seconds["fill"] += filled - started
        seconds["apply"] += applied - filled
        seconds["argmax"] += sampled - applied
        seconds["advance"] += time.process_time() - sampled
        tokens_seen.append(tokens)
    per_step_ms = {k: v / args.steps * 1e3 for k, v in seconds.items()}
    return {"per_step_cpu_ms": per_step_ms, "vocab_size": config.vocab_size,
            "tokens_hash": hashlib.sha256(orjson.dumps(tokens_seen)).hexdigest()[:16]}


def run_mask(args) -> None:
    torch.set_num_threads(args.threads)
    result = measure_mask(args)
    cpu = result["per_step_cpu_ms"]
    print(f"{args.rows} rows, vocabulary {result['vocab_size']}, {args.steps} steps; CPU ms per step: "
          + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()) + f", total {sum(cpu.values()):.3f}; "
          f"tokens hash {result['tokens_hash']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    p = probes.add_parser("decode", help="decode tok/s with and without a JSON schema; first-token delays")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated", "adaptive"))
    p.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--schemas", type=int, default=5, help="new schemas timed (each then again, cached)")
    p.add_argument("--result-json", default=None)
    p.set_defaults(run=run_decode)
    p = probes.add_parser("mask", help="CPU time of the grammar-mask path alone")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.set_defaults(run=run_mask)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
