"""Decode step of the `base` demo model on CUDA: captured CUDA graph against eager, per batch size.

    python -m bench.decode_graph_bench [--model demo:base] [--context 1024]

Target (issue 4): with graphs at least 3x faster than eager. Prints a table; JSON to $OUT or bench/out/.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from engine.actors.planner import StepPlanner
from engine.config import ModelConfig
from engine.core.batch import Batch
from engine.core.block_manager import BlockManager
from engine.core.messages import Request
from engine.core.sequence import Sequence
from engine.topology import resolve_model_dir
from engine.worker.model_runner import ModelRunner, load_model
from engine.worker.step import StepInput


def decode_step(num_seqs: int, context: int, blocks: BlockManager) -> StepInput:
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(Request(str(i), tuple(range(3, 3 + context))), output_token_ids=[5],
                       num_computed_tokens=context + 1)
        seq.block_table = blocks.grow(seq.request_id, context + 1)
        seqs.append(seq)
    return StepPlanner().step_input(Batch(decode=tuple(seqs)))


def time_forward(runner: ModelRunner, step: StepInput, iters: int) -> float:
    runner.apply(step)
    with torch.inference_mode():
        for _ in range(3):
            runner.logits(step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            runner.logits(step)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_graph_bench: CUDA is not available; nothing to measure")
        return 0
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = ModelConfig.from_dir(resolve_model_dir(args.model))
    model = load_model(config, torch.bfloat16, torch.device("cuda"), args.context + 16)
    per_seq = -(-(args.context + 1) // 16)
    num_blocks = per_seq * max(sizes)
    eager = ModelRunner(model, num_blocks, 16, frozenset())
    graphed = ModelRunner(model, num_blocks, 16, frozenset(), graph_max_batch=max(sizes), max_blocks_per_seq=per_seq)
    rows = []
    for size in sizes:
        step = decode_step(size, args.context, BlockManager(num_blocks, 16))
        eager_s, graph_s = time_forward(eager, step, args.iters), time_forward(graphed, step, args.iters)
        rows.append({"batch": size, "context": args.context, "eager_ms": eager_s * 1e3,
                     "graph_ms": graph_s * 1e3, "speedup": eager_s / graph_s})
    print(f"{'batch':>6} {'eager ms':>10} {'graph ms':>10} {'speed-up':>9}   (target >= 3x)")
    for r in rows:
        print(f"{r['batch']:>6} {r['eager_ms']:>10.3f} {r['graph_ms']:>10.3f} {r['speedup']:>8.2f}x")
    out = Path(os.environ.get("OUT") or "bench/out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_graph_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                             "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
