"""How many tokens a verify step could keep at best: plain greedy output replayed through the n-gram proposer.

    python experiments/draft_ceiling.py --model DIR/hf --dtype float32 --max-tokens 256

For the prompts of `speculative_bench` (an edit prompt over a code passage, a prose passage to repeat, an
open-ended story), the engine
decodes greedily without speculation; then, at each position of that output, the proposer drafts from the
prompt and the output so far and the drafts are checked against the output itself, as greedy verification
would. Each line: verify steps needed, accepted draft tokens, tokens per step, for each K and n-gram range, with
every draft verified (no cost gate). With `verify_phases`' ratio r(K) of a verify step's time to a plain step's,
tokens per step / r(K) bounds what n-gram speculation can give this model on this prompt.
"""
from __future__ import annotations

import argparse

import numpy as np

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.speculative import propose_ngram
from pdserve.engine.llm import LLM

from speculative_bench import DEFAULT_PASSAGE_FILE, DEFAULT_QUOTE_FILE, prompts

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--passage-tokens", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset-path", default=str(DEFAULT_PASSAGE_FILE),
                        help="a text file (or folder) the overlap prompt quotes, as speculative_bench's")
    parser.add_argument("--quote-path", default=str(DEFAULT_QUOTE_FILE),
                        help="text file the quote prompt's prose passage comes from ('' for none)")
    parser.add_argument("--speculative-tokens", default="4,7,16", help="comma-separated K values")
    args = parser.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
