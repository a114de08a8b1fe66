"""Two actors on one GPU, in both modes, against the CPU path: greedy tokens must be identical.

    python -m pdserve.bench.gpu_parity [--device cuda:0] [--model demo:base] [--max-tokens 32] [--out DIR]

Runs the same seeded prompts greedily through `--mode colocated` and `--mode disaggregated` with
both actors on `--device` (float32, so the two paths differ only by kernel rounding) and through
the CPU path (plain-torch references), and reports per mode how many sequences match the CPU's
token for token and where the first difference is. Writes DIR/gpu_parity.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM

MODES = ("colocated", "disaggregated")


def prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 64, 333, 1200)]


def greedy_tokens(model: str, mode: str, device: str, inputs: list[list[int]], max_tokens: int) -> tuple:
    config = EngineConfig(model=model, dtype="float32", mode=mode, prefill_device=device, decode_device=device,
                          cache=CacheConfig(kv_cache_memory="1GiB"), scheduler=SchedulerConfig(max_num_seqs=16))
    started = time.perf_counter()
    llm = LLM(config=config)
    ready = time.perf_counter() - started
    try:
        outputs = llm.generate(inputs, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    return [list(o.token_ids) for o in outputs], ready


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run(model: str, device: str, max_tokens: int, seed: int) -> dict:
    from pdserve.engine.model.config import ModelConfig
    from pdserve.engine.model.resolve import resolve_model

    inputs = prompts(seed, ModelConfig.from_dir(resolve_model(model).path).vocab_size)
    reference, _ = greedy_tokens(model, "colocated", "cpu", inputs, max_tokens)
    rows = []
    for mode in MODES:
        tokens, ready = greedy_tokens(model, mode, device, inputs, max_tokens)
        differences = [first_difference(t, r) for t, r in zip(tokens, reference)]
        rows.append({"mode": mode, "device": device, "sequences": len(inputs),
                     "identical": sum(d is None for d in differences), "first_difference": differences,
                     "start_seconds": ready})
    return {"model": model, "max_tokens": max_tokens, "prompt_lens": [len(p) for p in inputs], "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="demo:base")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    args = p.parse_args(argv)
    result = run(args.model, args.device, args.max_tokens, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_parity.json").write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        print(f"{row['mode']:<14} on {row['device']}: {row['identical']}/{row['sequences']} sequences identical "
              f"to the CPU path (first differences {row['first_difference']}); ready in {row['start_seconds']:.1f} s")
    return 0 if all(row["identical"] == row["sequences"] for row in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
