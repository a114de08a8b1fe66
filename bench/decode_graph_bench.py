"""Decode step of the `base` demo model on CUDA: captured CUDA graph against eager, per batch size.

    python -m pdserve.bench.decode_graph_bench [--model demo:base] [--context 1024] [--device cuda:0] [--out DIR]

Target (issues 4 and 14): at batch 1, graphs at least 3x the eager step rate. Prints a table; JSON to
DIR/decode_graph_bench.json (DIR: --out, else $OUT, else bench/out). `--device cpu` times eager only
(a dry run of the script).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pdserve.engine.actors.runner_rows import RunnerRows
from pdserve.engine.config import ModelConfig
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.step import StepInput

TARGET = 3.0


def decode_step(num_seqs: int, context: int, blocks: BlockManager) -> StepInput:
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(Request(str(i), tuple(range(3, 3 + context))), output_token_ids=[5],
                       num_computed_tokens=context + 1)
        seq.block_table = blocks.grow(seq.request_id, context + 1)
        seqs.append(seq)
    return RunnerRows().step_input(Batch.of(tuple(seqs)))


def time_forward(runner: ModelRunner, step: StepInput, iters: int) -> float:
    runner.apply(step)
    with torch.inference_mode():
        for _ in range(3):
            runner.logits(step)
        synchronize(runner.device)
        start = time.perf_counter()
        for _ in range(iters):
            runner.logits(step)
        synchronize(runner.device)
    return (time.perf_counter() - start) / iters


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = measure(args, device, [int(b) for b in args.batch_sizes.split(",")])
    print(f"{'batch':>6} {'eager ms':>10} {'graph ms':>10} {'speed-up':>9}   (target at batch 1: >= {TARGET:g}x)")
    for r in rows:
        graph = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.3f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"{r['batch']:>6} {r['eager_ms']:>10.3f} {graph:>10} {speedup:>9}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (out / "decode_graph_bench.json").write_text(json.dumps({"device": name, "target_speedup_batch_1": TARGET,
                                                             "rows": rows}, indent=2))
    return 0


def measure(args: argparse.Namespace, device: torch.device, sizes: list[int]) -> list[dict]:
    config = ModelConfig.from_dir(resolve_model(args.model).path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(config, dtype, device, args.context + 16)
    per_seq = -(-(args.context + 1) // 16)
    num_blocks = per_seq * max(sizes)
    eager = ModelRunner(model, num_blocks, 16, frozenset())
    graphed = (ModelRunner(model, num_blocks, 16, frozenset(), graph_max_batch=max(sizes), max_blocks_per_seq=per_seq)
               if device.type == "cuda" else None)
    rows = []
    for size in sizes:
        step = decode_step(size, args.context, BlockManager(num_blocks, 16))
        eager_s = time_forward(eager, step, args.iters)
        graph_s = time_forward(graphed, step, args.iters) if graphed is not None else None
        rows.append({"batch": size, "context": args.context, "eager_ms": eager_s * 1e3,
                     "graph_ms": graph_s and graph_s * 1e3, "speedup": graph_s and eager_s / graph_s})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
