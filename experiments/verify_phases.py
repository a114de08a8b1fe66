"""Where a one-row verify step's time goes on this machine: a plain decode step against a verification of
K drafts (K + 1 positions) of one row at a given context, phase by phase, in one process.

    python experiments/verify_phases.py --model DIR/hf --dtype float32 --context 400 --drafts 0,4,8,16

Phases (median over --repeats, milliseconds): `prepare` (the step's inputs: row tables, uploads), `forward`
(every layer: projections and attention), `logits` (the final norm's rows through the vocabulary projection),
`verify` (verification from the logits: kept drafts and the token after them; for K = 0 the sampler's greedy
pick), and `total` (the runner's launch and read-back, as a step runs). Each K also prints its total over the
plain step's. `--sampled` verifies with temperature 1 (rejection sampling) instead of greedy, `--profile`
prints torch.profiler's top operators of the largest K's step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.spec_verify import verify_on_device
from pdserve.engine.worker.startup.warmup import time_one_call_steps, warm_cpu_linears
from pdserve.engine.worker.step import ChunkInput, NewRow, StepInput, VerifyInput

BLOCK = 16


def build(model_dir: str, dtype: torch.dtype, context: int, most_drafts: int, params: SamplingParams
          ) -> tuple[ModelRunner, list[int]]:
    """A runner holding one row with `context` prompt tokens prefilled, its kernels decided as serving's are."""
    config = ModelConfig.from_dir(model_dir)
    length = context + most_drafts + 1
    blocks = -(-length // BLOCK)
    runner = ModelRunner(load_model(config, dtype, torch.device("cpu"), length + BLOCK), blocks, BLOCK, frozenset())
    threads = (torch.get_num_threads(),)
    warm_cpu_linears(runner.model, threads)                # NOTE: as serving decides its kernels and decode path
    time_one_call_steps(runner, threads)
    tokens = [(7 * i + 3) % 1000 + 100 for i in range(context)]
    row = NewRow(0, tuple(tokens), context, tuple(range(blocks)), params)
    runner.execute(StepInput(new_rows=(row,), chunks=(ChunkInput(0, 0, context, True),)))
    return runner, tokens


def step_for(tokens: list[int], drafts: int) -> StepInput:
    """A decode step at the context's end (K = 0) or a verification of `drafts` drafts from there."""
    position = len(tokens)
    if not drafts:
        return StepInput(decode_rows=(0,), decode_positions=(position,))
    return StepInput(verify=(VerifyInput(0, position, tuple(tokens[-1 - drafts:])),))


@torch.inference_mode()
def phases(runner: ModelRunner, step: StepInput) -> dict[str, float]:
    timings, started = {}, time.perf_counter()
    batch = runner.prepare(step)
    timings["prepare"], started = time.perf_counter() - started, time.perf_counter()
    hidden = runner.model(batch, runner.kv_pool)
    timings["forward"], started = time.perf_counter() - started, time.perf_counter()
    logits = runner.model.compute_logits(hidden[batch.logits_indices])
    timings["logits"], started = time.perf_counter() - started, time.perf_counter()
    if step.verify:
        verified = verify_on_device(runner.sampler, runner.sampling, logits, step.verify)
        verified.kept.tolist()
    else:
        runner.sampler.sample(logits, runner.sampling.batch(torch.zeros(1, dtype=torch.long).numpy())).tokens.tolist()
    timings["verify"], started = time.perf_counter() - started, time.perf_counter()
    runner.execute(step)
    timings["total"] = time.perf_counter() - started
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--drafts", default="0,4,8,16", help="comma-separated K values (0: a plain decode step)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--sampled", action="store_true", help="temperature 1 (rejection sampling), not greedy")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = sorted({int(k) for k in args.drafts.split(",")} | {0})
    params = SamplingParams(temperature=1.0 if args.sampled else 0.0, seed=1 if args.sampled else None,
                            max_tokens=1 << 20)
    runner, tokens = build(args.model, getattr(torch, args.dtype), args.context, max(ks), params)
    names = ("prepare", "forward", "logits", "verify", "total")
    print(f"context {args.context}, {torch.get_num_threads()} threads, {'sampled' if args.sampled else 'greedy'}; ms:")
    print(f"{'K':>3} " + " ".join(f"{n:>8}" for n in names) + "  total/plain")
    plain = None
    for k in ks:
        step = step_for(tokens, k)
        for _ in range(3):
            phases(runner, step)
        runs = [phases(runner, step) for _ in range(args.repeats)]
        median = {n: 1e3 * statistics.median(r[n] for r in runs) for n in names}
        plain = plain or median["total"]
        print(f"{k:>3} " + " ".join(f"{median[n]:8.2f}" for n in names) + f"  {median['total'] / plain:.2f}x")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        step = step_for(tokens, max(ks))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runner.execute(step)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
