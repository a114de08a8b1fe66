"""CPU time of the grammar-mask path of one decode step, without a model: `--rows` rows of the same
JSON-schema matcher as `structured_bench` (SmolLM2's tokenizer by default), for `--steps` steps of
fill (llguidance, `RowConstraints.constraints`) -> apply (`StepConstraints.to` + `.apply`: the bitmask
onto fp32 logits) -> greedy argmax -> advance (the matchers consume the tokens).

    python experiments/mask_bench.py --rows 32 --steps 128

Logits are seeded random numbers, so every run walks the same paths through the grammar. Each phase is
timed by `time.process_time` (CPU time of the whole process, every thread: what the phase takes from the
cores the forward also needs), so the figures mean something on a busy machine too; wall time is not
reported. torch runs single-threaded here (`--threads`) so that no spinning worker thread inflates them.
"""
from __future__ import annotations

import argparse
import hashlib
import time

import orjson
import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.text.grammar import json_schema_grammar
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.worker.sampling.constraints import RowConstraints

from structured_bench import ENDLESS


def measure(args: argparse.Namespace) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args)
    cpu = result["per_step_cpu_ms"]
    print(f"{args.rows} rows, vocabulary {result['vocab_size']}, {args.steps} steps; CPU ms per step: "
          + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()) + f", total {sum(cpu.values()):.3f}; "
          f"tokens hash {result['tokens_hash']}")


if __name__ == "__main__":
    main()
