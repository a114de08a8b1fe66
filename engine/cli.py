"""`pdserve generate` and `pdserve make-model`: offline generation and the demo checkpoint."""
from __future__ import annotations

import argparse
import sys

import orjson

from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.core.sampling_params import SamplingParams


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: read lines from stdin)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same output")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")


def run_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.llm import LLM
    from pdserve.engine.transfer.base import TransferUnavailable

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("pdserve generate: no prompts given", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    try:
        llm = LLM(config=engine_config_from_args(args))
    except (OSError, ValueError, TransferUnavailable) as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    try:
        inputs = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) if args.chat else p
                  for p in prompts]
        for prompt, output in zip(prompts, llm.generate(inputs, params)):
            record = {"prompt": prompt, "text": output.text, "token_ids": list(output.token_ids),
                      "finish_reason": output.finish_reason, "num_prompt_tokens": len(output.prompt_token_ids)}
            if output.error:
                record["error"] = output.error
            sys.stdout.write(orjson.dumps(record).decode() + "\n")
    finally:
        llm.close()
    return 0


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="DIR")
    parser.add_argument("--size", choices=("tiny", "base"), default="tiny")
    parser.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--seed", type=int, default=0)


def run_make_model(args: argparse.Namespace) -> int:
    from pdserve.engine.model.demo import make_model

    path = make_model(args.out_dir, size=args.size, arch=args.arch, seed=args.seed)
    print(path)
    return 0
