"""Offline throughput: pdserve's engine against transformers' `generate` on the same checkpoint and prompts.

    python -m bench.offline_throughput --num-prompts 32 --input-len 128 --output-len 128 --compare-transformers

Prefill tokens/s comes from a max_tokens=1 pass, decode tokens/s from the rest of a full pass.
Each engine runs in its own fresh subprocess, one after the other in the same run (a CPU thread
team one engine leaves behind slows the other: bench/RESULTS.md). Prints one summary line per
engine and writes the full result as JSON.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace

import orjson
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.topology import resolve_model_dir

RESULT_PREFIX = "offline-throughput-result: "


def seeded_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=generator).tolist()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_pdserve(args, prompts) -> dict:
    overlap = {"on": True, "off": False, "auto": None}[args.async_scheduling]
    config = EngineConfig(model=args.model, dtype=args.dtype, mode=args.mode, async_scheduling=overlap,
                          cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
                          scheduler=SchedulerConfig(max_num_seqs=max(args.num_prompts, 1),
                                                    max_prefill_tokens=args.max_prefill_tokens))
    llm = LLM(config=config)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:2], replace(greedy, max_tokens=4))                    # warm-up
        prefill_s = timed(lambda: llm.generate(prompts, replace(greedy, max_tokens=1)))
        decode_actor = llm.engine.actors[-1]
        step_before, forward_before = decode_actor.step_seconds, decode_actor.runner.forward_seconds
        steps_before = decode_actor.steps
        total_s = timed(lambda: llm.generate(prompts, greedy))
        step_s = decode_actor.step_seconds - step_before
        forward_s = decode_actor.runner.forward_seconds - forward_before
        steps = decode_actor.steps - steps_before
    finally:
        llm.close()
    n, inp, out = len(prompts), args.input_len, args.output_len
    return {"engine": f"pdserve-{llm.engine.mode}", "dtype": str(llm.engine.plan.dtype),
            "prefill_tok_s": n * inp / prefill_s, "decode_tok_s": n * (out - 1) / max(total_s - prefill_s, 1e-9),
            "total_s": total_s, "prefill_s": prefill_s, "decode_steps": steps,
            "step_ms": total_s / max(steps, 1) * 1e3,                      # wall time per step
            "host_ms": step_s / max(steps, 1) * 1e3,                       # schedule + launch + record
            "device_ms": forward_s / max(steps, 1) * 1e3}                  # forward + sampling


def bench_transformers(args, prompts) -> dict:
    import transformers

    dtype = getattr(torch, args.dtype or "bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=dtype).eval()
    ids = torch.tensor(prompts)

    def generate(new_tokens):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)

    generate(4)
    prefill_s = timed(lambda: generate(1))
    total_s = timed(lambda: generate(args.output_len))
    n, inp, out = len(prompts), args.input_len, args.output_len
    return {"engine": "transformers-generate", "dtype": str(dtype), "prefill_tok_s": n * inp / prefill_s,
            "decode_tok_s": n * (out - 1) / max(total_s - prefill_s, 1e-9), "total_s": total_s,
            "prefill_s": prefill_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--mode", default=None, choices=("disaggregated", "colocated"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-scheduling", choices=("on", "off", "auto"), default="auto",
                   help="schedule each step while the previous one runs (auto: the engine's default)")
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--result-json", default=None)
    p.add_argument("--engine", choices=("pdserve", "transformers"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        return _run_one(args)
    engines = ["pdserve"] + (["transformers"] if args.compare_transformers else [])
    results = [_in_subprocess(args, engine) for engine in engines]
    for r in results:
        steps = (f"   step {r['step_ms']:.2f} ms (host {r['host_ms']:.2f}, device {r['device_ms']:.2f})"
                 if "step_ms" in r else "")
        print(f"{r['engine']:<28} {r['dtype']:<15} prefill {r['prefill_tok_s']:9.1f} tok/s   "
              f"decode {r['decode_tok_s']:8.1f} tok/s" + steps)
    if len(results) == 2:
        print(f"decode speed-up over transformers: {results[0]['decode_tok_s'] / results[1]['decode_tok_s']:.2f}x")
    record = {"args": vars(args), "machine": {"cpu": platform.processor() or platform.machine(),
                                              "cores": len(os.sched_getaffinity(0)),
                                              "torch": torch.__version__}, "results": results}
    if args.result_json:
        with open(args.result_json, "wb") as f:
            f.write(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    return 0


def _run_one(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    prompts = seeded_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    result = bench_pdserve(args, prompts) if args.engine == "pdserve" else bench_transformers(args, prompts)
    print(RESULT_PREFIX + orjson.dumps(result).decode())
    return 0


def _in_subprocess(args: argparse.Namespace, engine: str) -> dict:
    child = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
             if value is not None and name not in ("result_json", "compare_transformers", "engine")]
    out = subprocess.run([sys.executable, "-m", "bench.offline_throughput", *child, f"--engine={engine}"],
                         check=True, capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if line.startswith(RESULT_PREFIX))
    return orjson.loads(line[len(RESULT_PREFIX):])


if __name__ == "__main__":
    raise SystemExit(main())
