"""The ceiling of speculative decoding on a model: how many drafts a verify step could keep, and what it costs.

    python experiments/spec_ceiling.py replay --model DIR/hf --dtype float32 --max-tokens 256
    python experiments/spec_ceiling.py verify --model DIR/hf --dtype float32 --context 400 --drafts 0,4,8,16

replay: for `speculative_bench`'s prompts (a code passage to edit, a prose passage to repeat, an open-ended
story) the engine decodes greedily without speculation; then at each position of that output the n-gram
proposer drafts from the prompt and the output so far, and the drafts are checked against the output itself,
as greedy verification would, with no cost gate: verify steps, kept drafts and tokens per step for each K and
lookup range.

verify: one row's plain decode step against a verification of K drafts (K + 1 positions) at a given context,
phase by phase, median over --repeats (ms): `prepare` (row tables, uploads), `forward` (every layer), `logits`
(the final norm's rows through the vocabulary projection), `verify` (kept drafts and the token after them; for
K = 0 the sampler's greedy pick), `total` (the step as the runner runs it), and each K's total over the plain
step's: r(K). Tokens per step / r(K) bounds what n-gram speculation can give this model on a prompt.
`--sampled` verifies with temperature 1 (rejection sampling); `--profile` prints torch.profiler's top operators
of the largest K's step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.speculative import propose_ngram
from pdserve.engine.llm import LLM
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.spec_verify import verify_on_device
from pdserve.engine.worker.startup.warmup import time_one_call_steps, warm_cpu_linears
from pdserve.engine.worker.step import ChunkInput, NewRow, StepInput, VerifyInput

from speculative_bench import DEFAULT_PASSAGE_FILE, DEFAULT_QUOTE_FILE, prompts


# replay

LOOKUPS = ((1, 4), (2, 4), (3, 5))


def replay(prompt: list[int], output: list[int], k: int, n_min: int, n_max: int) -> tuple[int, int]:
    """(verify steps, accepted drafts) to produce `output` with every step drafting up to `k` tokens."""
    position = steps = accepted = 0
    while position < len(output):
        drafts = propose_ngram(np.array(prompt + output[:position]), k, n_min, n_max)
        kept = 0
        while kept < len(drafts) and position + kept < len(output) and drafts[kept] == output[position + kept]:
            kept += 1
        position, steps, accepted = position + kept + 1, steps + 1, accepted + kept
    return steps, accepted


def run_replay(args) -> None:
    llm = LLM(config=EngineConfig(model=args.model, mode="colocated", dtype=args.dtype,
                                  cache=CacheConfig(enable_prefix_caching=False)))
    try:
        for name, prompt in prompts(llm, args.passage_tokens, args.seed, args.dataset_path, args.quote_path).items():
            [out] = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
            output = list(out.token_ids)
            for k in (int(v) for v in args.speculative_tokens.split(",")):
                for n_min, n_max in LOOKUPS:
                    steps, accepted = replay(prompt, output, k, n_min, n_max)
                    print(f"{name:>10}: K={k:<2} lookup {n_min}-{n_max}: {steps} verify steps for {len(output)} "
                          f"tokens, {accepted} drafts kept, {len(output) / steps:.2f} tokens a step")
    finally:
        llm.close()


# verify

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


def run_verify(args) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    p = probes.add_parser("replay", help="plain greedy output replayed through the n-gram proposer")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--passage-tokens", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset-path", default=str(DEFAULT_PASSAGE_FILE),
                   help="a text file (or folder) the overlap prompt quotes, as speculative_bench's")
    p.add_argument("--quote-path", default=str(DEFAULT_QUOTE_FILE),
                   help="text file the quote prompt's prose passage comes from ('' for none)")
    p.add_argument("--speculative-tokens", default="4,7,16", help="comma-separated K values")
    p.set_defaults(run=run_replay)
    p = probes.add_parser("verify", help="a verify step of K drafts against a plain step, phase by phase")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--drafts", default="0,4,8,16", help="comma-separated K values (0: a plain decode step)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--sampled", action="store_true", help="temperature 1 (rejection sampling), not greedy")
    p.add_argument("--profile", action="store_true")
    p.set_defaults(run=run_verify)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
