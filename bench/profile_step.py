"""Time and profile one model step of the engine's runner: a decode batch or a prefill batch.

    python -m pdserve.bench.profile_step --phase decode --batch 32 --context 200 --threads 2
    python -m pdserve.bench.profile_step --phase prefill --batch 32 --context 128 --threads 2

Prints the mean step time and torch.profiler's top operators (where a CPU step's time goes).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from pdserve.engine.actors.runner_rows import RunnerRows
from pdserve.engine.config import DTYPES, ModelConfig
from pdserve.engine.core.batch import Batch, ScheduledChunk
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.worker.memory import keep_freed_memory_in_process
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.step import StepInput

GREEDY = SamplingParams(temperature=0.0)


def make_step(phase: str, batch: int, context: int, blocks: BlockManager) -> StepInput:
    seqs = []
    for i in range(batch):
        seq = Sequence(Request(str(i), tuple(range(3, 3 + context)), GREEDY))
        if phase == "decode":
            seq.output_token_ids, seq.num_computed_tokens = [5], context + 1
        seq.block_table = blocks.grow(seq.request_id, context + 1)
        seqs.append(seq)
    if phase == "decode":
        return RunnerRows().step_input(Batch(decode=tuple(seqs)))
    return RunnerRows().step_input(Batch(chunks=tuple(ScheduledChunk(s, 0, context, True) for s in seqs)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--phase", default="decode", choices=("decode", "prefill"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rows", type=int, default=12, help="profiler rows to print")
    p.add_argument("--quantization", default="none", help="as pdserve's --quantization (gguf: the file's blocks)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory_in_process()
    config = ModelConfig.from_dir(resolve_model(args.model).path)
    num_blocks = args.batch * (-(-(args.context + 1) // 16))
    runner = ModelRunner(load_model(config, DTYPES[args.dtype], torch.device("cpu"), args.context + 16,
                                    args.quantization, args.threads),
                         num_blocks, 16, frozenset())
    runner.kv_pool.normal_()                     # touch the pool as a real run's prefill would
    step = make_step(args.phase, args.batch, args.context, BlockManager(num_blocks, 16))
    runner.apply(step)
    run = replace(step, freed_rows=(), new_rows=())                  # the rows stay; run the same step again
    for _ in range(2):
        runner.execute(run)
    start = time.perf_counter()
    for _ in range(args.iters):
        runner.execute(run)
    step_ms = (time.perf_counter() - start) / args.iters * 1e3
    with torch.profiler.profile() as prof:
        runner.execute(run)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    tokens = step.num_tokens
    print(f"{args.phase} step: {step_ms:.1f} ms for {tokens} tokens ({tokens / step_ms * 1e3:.0f} tok/s), "
          f"batch {args.batch}, context {args.context}, {args.threads} threads, {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
