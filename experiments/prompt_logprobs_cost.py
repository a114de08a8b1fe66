"""What asking for prompt logprobs costs: a scored prompt's time to its first token against a plain one's.

    python experiments/prompt_logprobs_cost.py [--model smollm2] [--prompt-len 512] [--top 0,1,20] [--runs 5]

One colocated engine, prefix caching off (a plain prompt would otherwise be served from the cache), one
request at a time: a prompt of --prompt-len random token ids, max_tokens 1, without prompt_logprobs and with
each --top value, after one untimed round. Prints the median seconds of each and its ratio to plain; --json
writes every run.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import orjson

from pdserve.bench.documents import machine_description
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.llm import new_event_loop


async def timings(engine: Engine, prompt_len: int, cases: list[int | None], runs: int) -> dict[str, list[float]]:
    """Seconds of each case's request, one at a time, after one untimed request of each."""
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    seconds: dict[str, list[float]] = {str(k): [] for k in cases}
    await engine.start()
    try:
        for run in range(runs + 1):
            prompt = tuple(rng.randrange(vocab) for _ in range(prompt_len))
            for k in cases:
                request = Request(f"r{run}-{k}", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         prompt_logprobs=k))
                started = time.perf_counter()
                async for _ in engine.submit(request):
                    pass
                if run:
                    seconds[str(k)].append(time.perf_counter() - started)
    finally:
        await engine.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--top", default="0,1,20", help="prompt_logprobs values to time, comma-separated")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, mode="colocated", cache=CacheConfig(enable_prefix_caching=False)))
    cases = [None] + [int(k) for k in args.top.split(",")]
    loop = new_event_loop()
    try:
        seconds = loop.run_until_complete(timings(engine, args.prompt_len, cases, args.runs))
    finally:
        loop.close()
        engine.close()
    plain = statistics.median(seconds["None"])
    print(f"{args.model}, {args.prompt_len}-token prompt, median of {args.runs}: plain {plain:.3f} s; " + "; ".join(
        f"prompt_logprobs={k} {statistics.median(seconds[str(k)]):.3f} s "
        f"({statistics.median(seconds[str(k)]) / plain:.2f}x)" for k in cases[1:]))
    if args.json:
        with open(args.json, "wb") as out:
            out.write(orjson.dumps({"machine": machine_description(), "args": vars(args), "seconds": seconds}))


if __name__ == "__main__":
    main()
