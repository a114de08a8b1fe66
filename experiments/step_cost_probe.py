"""How well the start-up profile's step cost models predict steps it did not run.

    python experiments/step_cost_probe.py --model smollm2 --mode adaptive

Loads the engine's units as `pdserve serve` would, runs the start-up profile (the fits the router and the SLO
planner start from), then times probe prefill steps of one and several prompts on each unit at each thread count
the plan gives it (the median of three runs) and prints measured, predicted and their ratio. Run it on a quiet
machine, a few times: each start-up fits anew. Each row is one (unit, threads, prompts x tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics

from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.coordinator.profile import measure_units, run_shape
from pdserve.engine.core.batch import attention_pairs
from pdserve.engine.engine import Engine
from pdserve.engine.worker.startup.warmup import StepShape

PROBES = ((16, 128), (4, 128), (1, 128), (1, 256), (1, 2048))      # (prompts, tokens each) of a probe step
REPEATS = 3


async def probe(config) -> list[tuple[str, int | None, int, int, float, float]]:
    """(unit, threads, prompts, tokens, measured s, predicted s) for every probe."""
    engine = Engine(config)                           # the units as `pdserve serve` loads them (not started)
    units, vocab = engine.units, engine.model_config.vocab_size
    try:
        measured = await measure_units(config.scheduler, engine.layout, units, vocab, engine.mode.decode_units_prefill)
        if measured is None:
            raise SystemExit("the start-up profile is off (--no-startup-profile): nothing to probe")
        share = engine.layout.lending
        sides = [("decode", units.decoding[0], measured.decode, share and (share.decode_own, share.total))]
        if units.prefills:
            sides.append(("prefill", units.prefills[0], measured.prefill, share and (share.prefill_own, share.total)))
        rows, rng = [], random.Random(0)
        for name, unit, cost, counts in sides:
            for threads in counts or (None,):
                for prompts, tokens in PROBES:
                    shape = StepShape("prefill", prompts, tokens)
                    runs = [await run_shape(unit, shape, threads, vocab, rng) for _ in range(REPEATS)]
                    seconds = statistics.median(run.seconds for run in runs)
                    predicted = cost.predict(threads, 0, prompts * tokens, pairs=prompts * attention_pairs(0, tokens))
                    rows.append((name, threads, prompts, tokens, seconds, predicted))
        return rows
    finally:
        units.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    rows = asyncio.run(probe(engine_config_from_args(parser.parse_args())))
    print("| unit | threads | prompts x tokens | measured ms | predicted ms | predicted / measured |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, threads, prompts, tokens, seconds, predicted in rows:
        print(f"| {name} | {threads} | {prompts} x {tokens} | {seconds * 1e3:.1f} | {predicted * 1e3:.1f} | "
              f"{predicted / seconds:.2f}x |")


if __name__ == "__main__":
    main()
