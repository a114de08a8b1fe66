"""`--hardware measured`: load this machine's real units (the model, the pools, the thread counts the plan
gives them), time a grid of synthetic steps on each, and fit each unit's step-cost coefficients."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Machine
from pdserve.engine.modes import choose_mode
from pdserve.engine.served import ServedModel
from pdserve.engine.sim.cost import FittedCost, StepShape, fit, step_shape
from pdserve.engine.sim.target import Target
from pdserve.engine.units.layout import make_layout
from pdserve.engine.units.spec import Layout
from pdserve.engine.units.threads import load_thread_units
from pdserve.engine.units.units import Units
from pdserve.engine.worker.openmp import on_single_threaded_loader
from pdserve.engine.worker.startup.warmup import StepShape as Synthetic
from pdserve.engine.worker.startup.warmup import synthetic_step
from pdserve.engine.worker.step import StepInput, StepWork

logger = logging.getLogger(__name__)
REPEATS = 3                      # the median of three runs of each step: one preempted run does not count


def measured_target(config: EngineConfig, profile_json: str | None = None, overhead: float | None = None) -> Target:
    """The Target of this machine's units for `config`: read from `profile_json` when that file exists (and
    was written for the same setup), else measured now (and written there when a path is given). Every step
    costs `overhead` seconds more; None: each unit's measured hand-off (`step_overhead`)."""
    if config.workers != "thread":
        raise ValueError("--hardware measured profiles thread units: drop --workers process (a worker process "
                         "steps the same model runner; its pipe adds a little per step)")
    served, machine = ServedModel.load(config.model), Machine.here(config)
    layout = make_layout(config, served.config, choose_mode(config.mode, machine.prefill[0], machine.decode[0]),
                         machine.prefill, machine.decode, machine.dtype, machine.cores)
    path = Path(profile_json) if profile_json else None
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        if data.get("setup") != setup(config, served.model_dir, layout):
            raise ValueError(f"--profile-json {path} was measured for another setup ({data.get('setup')}); "
                             "delete it to measure again")
    else:
        units = on_single_threaded_loader(load_thread_units, config, served.config, layout, served.eos_token_ids)
        try:
            data = {"setup": setup(config, served.model_dir, layout), "units": profile_units(config, layout, units)}
        finally:
            units.close()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1) + "\n")
    costs = tuple(replace(FittedCost.from_json(unit["cost"]),
                          overhead=unit.get("step_overhead", 0.0) if overhead is None else overhead)
                  for unit in data["units"])
    shape = replace(served.config, eos_token_ids=tuple(sorted(served.eos_token_ids)))
    return Target(shape, costs, machine=machine, num_blocks=tuple(unit["num_blocks"] for unit in data["units"]),
                  dtype_bytes=layout.dtype.itemsize)


def setup(config: EngineConfig, model_dir: Path, layout: Layout) -> str:
    """What a profile's figures depend on: the model, the units (role, device, cores), dtype and quantization."""
    units = " ".join(f"{spec.name}:{spec.device}:{','.join(map(str, spec.cores))}" for spec in layout.units)
    return (f"{model_dir} {units} {str(layout.dtype).removeprefix('torch.')} "
            f"quantization {config.quantization} kernels {config.cpu_kernels}")


def profile_units(config: EngineConfig, layout: Layout, units: Units) -> list[dict]:
    """Each unit (prefill units first): its pool's blocks, its fitted cost (one fit per thread count) and its
    `step_overhead`: the median seconds a step's result took to reach the loop beyond the step's own (the compute
    thread's hand-off), which a served step pays and the fits leave out."""
    bandwidth = copy_bandwidth(units)
    measured = []
    for spec, unit in zip(units.specs, units.computes):
        counts = spec.thread_counts if unit.device.type == "cpu" else (0,)
        fits, handoffs = {}, []
        for threads in counts:
            samples = asyncio.run(_time_grid(unit, config, layout.max_model_len, spec.warmup_role, threads or None,
                                             handoffs))
            fits[threads] = fit(samples)
            logger.info("measured %s at %s threads: %s", unit.device, threads, fits[threads])
        cost = FittedCost(fits, bandwidth, synchronous_copies=unit.device.type == "cpu")
        measured.append({"role": spec.warmup_role, "num_blocks": unit.num_blocks, "cost": cost.to_json(),
                         "step_overhead": statistics.median(handoffs)})
    return measured


def grid(role: str, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int) -> list[Synthetic]:
    """The steps timed: prefill chunks of growing size with and without a prefix, a full step of short prompts
    (its attention pairs few: it separates a token's cost from a pair's, which single prompts of growing size do
    not: fitted without it, many short prompts in one step were priced far below their time), decode batches of growing
    size at a short and a long context, and (colocated) decode rows with a chunk."""
    budget = min(max_prefill_tokens, max_model_len // 2)
    long_context = min(1024, max_model_len // 2)
    shapes = []
    if role != "decode":
        shapes += [Synthetic("prefill", 1, n) for n in sorted({16, 64, 256, budget}) if n <= budget]
        shapes += [Synthetic("prefill", 1, min(64, budget), context=long_context - min(64, budget))]
        shapes += [Synthetic("prefill", 1, budget // 2, context=budget // 2)]
        shapes += [Synthetic("prefill", max(1, budget // 64), min(64, budget))]
    if role != "prefill":
        rows = sorted({1, 4, 16, min(max_num_seqs, 32)})
        shapes += [Synthetic("decode", n, 1, context=c) for n in rows for c in (32, long_context)]
    if role == "colocated":
        shapes += [Synthetic("mixed", 9, min(128, budget), context=long_context)]
    return shapes


async def _time_grid(unit, config: EngineConfig, max_model_len: int, role: str, threads: int | None,
                     handoffs: list[float]) -> list[tuple[StepShape, float]]:
    """(shape, median seconds) of each grid step; each timed run's hand-off goes to `handoffs`."""
    sched, rng = config.scheduler, random.Random(0)
    samples = []
    for synthetic in grid(role, sched.max_num_seqs, sched.max_prefill_tokens, max_model_len):
        step = synthetic_step(synthetic, _vocab(unit), unit.block_size, unit.num_blocks, rng)
        runs = [await _run(unit, step, threads) for _ in range(REPEATS + 1)][1:]    # the first one warms up
        samples.append((step_shape(step), statistics.median(seconds for seconds, _ in runs)))
        handoffs.extend(handoff for _, handoff in runs)
    return samples


async def _run(unit, step: StepInput, threads: int | None) -> tuple[float, float]:
    """The step's seconds, and how much longer its result took to reach the loop."""
    started = time.perf_counter()
    outcome = await unit.submit(StepWork(step, threads=threads))
    handoff = max(time.perf_counter() - started - outcome.seconds, 0.0)
    await unit.submit(StepWork(StepInput(freed_rows=tuple(new.row for new in step.new_rows)), threads=threads))
    return outcome.seconds, handoff


def _vocab(unit) -> int:
    return unit.runner.model.config.vocab_size


def copy_bandwidth(units: Units) -> float:
    """Bytes per second of a KV hand-off from the first prefill unit to the first decode unit (the real
    transfer backend, 64 blocks or the pool); a colocated engine copies nothing (any positive figure)."""
    if not units.prefills:
        return 1e12
    prefill, decode = units.prefills[0], units.decoding[0]
    source = prefill.step_runner
    transfer, pool = source.peers[0]
    n = min(64, prefill.num_blocks, decode.num_blocks)
    blocks = tuple(range(n))
    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        handle = transfer.copy_blocks(source.runner.kv_pool, pool, blocks, blocks)
        handle.wait()
        seconds.append(handle.seconds or time.perf_counter() - started)
    return handle.nbytes / max(statistics.median(seconds), 1e-9)
