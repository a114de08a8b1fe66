"""How well the start-up profile's step cost models predict steps it did not run.

    python -m pdserve.bench.step_cost_probe --model smollm2 --mode adaptive

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
from pdserve.engine.config import ModelConfig
from pdserve.engine.core.batch import attention_pairs
from pdserve.engine.engine import measure_units, on_single_threaded_loader
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.topology import core_share, load_units, make_plan
from pdserve.engine.worker.startup.warmup import StepShape, synthetic_step
from pdserve.engine.worker.step import StepInput, StepWork

PROBES = ((16, 128), (4, 128), (1, 128), (1, 256), (1, 2048))      # (prompts, tokens each) of a probe step
REPEATS = 3


async def _seconds(unit, shape: StepShape, threads: int | None, vocab: int, rng: random.Random) -> float:
    step = synthetic_step(shape, vocab, unit.block_size, unit.num_blocks, rng)
    outcome = await unit.submit(StepWork(step, threads=threads))
    await unit.submit(StepWork(StepInput(freed_rows=tuple(row.row for row in step.new_rows)), threads=threads))
    return outcome.seconds


async def probe(config) -> list[tuple[str, int | None, int, int, float, float]]:
    """(unit, threads, prompts, tokens, measured s, predicted s) for every probe."""
    model = resolve_model(config.model)
    model_config = ModelConfig.from_dir(model.path)
    eos = Tokenizer.from_dir(model.path).eos_token_ids | frozenset(model_config.eos_token_ids)
    plan = make_plan(config, model_config)
    units = on_single_threaded_loader(load_units, config, model_config, plan, eos)
    try:
        measured = await measure_units(config, plan, units, model_config.vocab_size)
        if measured is None:
            raise SystemExit("the start-up profile is off (--no-startup-profile): nothing to probe")
        share = core_share(plan)
        sides = [("decode", units.decode, measured.decode, share and (share.decode_own, share.total))]
        if units.prefills:
            sides.append(("prefill", units.prefill, measured.prefill, share and (share.prefill_own, share.total)))
        rows, rng = [], random.Random(0)
        for name, unit, cost, counts in sides:
            for threads in counts or (None,):
                for prompts, tokens in PROBES:
                    shape = StepShape("prefill", prompts, tokens)
                    seconds = statistics.median([await _seconds(unit, shape, threads, model_config.vocab_size, rng)
                                                 for _ in range(REPEATS)])
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
