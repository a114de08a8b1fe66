"""`pdserve simulate`: replay a `pdserve bench` workload through the engine's own coordinator and actors on
a virtual clock, with step times from a cost model (a named GPU's roofline, or fits measured here), and
write the same result JSON as `pdserve bench --result-json` (docs/planning.md).

    pdserve simulate --hardware h200 --model-shape llama-8b --mode disaggregated \\
        --dataset-name mixed --num-prompts 200 --request-rate 4 --slo ttft_ms=500 itl_ms=100 --result-json sim.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import loadtest
from pdserve.bench.documents import arguments_dict, result_document, write_json
from pdserve.bench.metrics import format_summary
from pdserve.bench.multiturn import MULTITURN
from pdserve.bench.sim_replay import ChatOverhead, WordIds, chat_overhead, replay
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.turn_metrics import format_turns
from pdserve.bench.workloads import add_traffic_arguments, add_workload_arguments
from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.sim.clock import SimulationStalled, run_virtual
from pdserve.engine.sim.cost import DEFAULT_STEP_OVERHEAD_S, Roofline
from pdserve.engine.engine import Engine
from pdserve.engine.sim.target import Target, simulated_engine
from pdserve.engine.sim.hardware import HARDWARE, HARDWARE_CHOICES, MEASURED
from pdserve.engine.config import ModelConfig
from pdserve.engine.sim.shapes import NAMED_SHAPES


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("simulation")
    g.add_argument("--hardware", choices=HARDWARE_CHOICES, default="h200",
                   help="a named GPU's roofline (published FLOP/s, memory and link bandwidths), or measured: "
                        "profile this machine's units with the real model first and use the fitted step costs")
    g.add_argument("--model-shape", choices=sorted(NAMED_SHAPES), default=None,
                   help="a published model shape, no weights needed (default: --model's config.json)")
    g.add_argument("--step-overhead-ms", type=float, default=None,
                   help="fixed host and launch time added to every step (default: 1 ms on named hardware; with "
                        "measured, each unit's hand-off from its compute thread to the loop, timed with its profile)")
    g.add_argument("--profile-json", default=None,
                   help="measured: read the fitted step costs from this file if it exists, else measure and "
                        "write them there")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `pdserve simulate` flag: the engine's (as `pdserve serve`), the workload's (as `pdserve bench`)."""
    add_engine_args(parser)
    add_workload_arguments(parser)
    add_traffic_arguments(parser)
    loadtest.add_metric_arguments(parser)
    add_simulation_arguments(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--result-json", default=None, help="the prediction, in `pdserve bench --result-json`'s schema")
    g.add_argument("--label", default=None, help="name of this run in the JSON")
    g.add_argument("--compare", default=None, metavar="RESULT.json",
                   help="a `pdserve bench --result-json` of the same workload: print predicted vs measured")


@dataclass(frozen=True, slots=True)
class Simulation:
    """A finished simulated run: its result, the summary `pdserve bench` would print, the engine it ran."""

    result: object
    summary: dict
    engine: Engine


def target_from_args(args: argparse.Namespace, config: EngineConfig) -> Target:
    """The simulated units' shape and cost model; raises ValueError naming the option."""
    measured = args.hardware == MEASURED
    overhead_ms = args.step_overhead_ms if args.step_overhead_ms is not None else \
        None if measured else DEFAULT_STEP_OVERHEAD_S * 1e3
    if overhead_ms is not None and overhead_ms < 0:
        raise ValueError("--step-overhead-ms must be non-negative")
    if measured:
        from pdserve.engine.sim.profile import measured_target

        if args.model_shape:
            raise ValueError("--hardware measured profiles the real model: give --model, not --model-shape")
        return measured_target(config, args.profile_json, None if overhead_ms is None else overhead_ms / 1e3)
    shape = model_shape(args.model_shape, config.model)
    hardware = HARDWARE[args.hardware]
    return Target(shape, Roofline(shape, hardware, overhead=overhead_ms / 1e3), hardware)


def model_shape(name: str | None, model: str | None) -> ModelConfig:
    if name:
        return NAMED_SHAPES[name]
    return ModelConfig.from_dir(resolve_model(model).path)


def simulate(config: EngineConfig, target: Target, options: loadtest.Options, tokens_per_word: float,
             chat: ChatOverhead | None = None) -> Simulation:
    """Run `options`' workload through a SimEngine for `target` on a virtual clock (`chat`: the tokens the
    model's chat template adds to a chat request)."""
    async def main() -> Simulation:
        engine = simulated_engine(config, target)
        answer = engine.units.decoding[0].model.token_id
        ids = WordIds(engine.model_config.vocab_size, answer, tokens_per_word, frozenset(target.shape.eos_token_ids),
                      chat)
        await engine.start()
        try:
            result = await replay(engine, ids, options)
        finally:
            await engine.stop()
        return Simulation(result, loadtest.summarize_run(result, options), engine)

    return run_virtual(main())


def units_line(engine: Engine) -> str:
    """What each simulated unit did: steps, the share of the simulated time (warm-ups included) it was busy,
    what the coordinator sent it, and the real host time its actor spent per step."""
    parts, units = [], engine.units.computes
    span = max((start + seconds for unit in units for start, seconds in unit.steps), default=0.0)
    for actor, unit in zip(engine.coordinator.actors, units):
        stats = actor.stats()
        busy = sum(seconds for _, seconds in unit.steps)
        placed = f", {stats.local_prefills} local / {stats.remote_prefills} remote prefills" \
            if stats.local_prefills or stats.remote_prefills else ""
        host = actor.step_seconds / stats.steps * 1e3 if stats.steps else 0.0
        parts.append(f"{actor.unit_name}: {stats.steps} steps, busy {busy / span if span else 0.0:.0%}, "
                     f"{stats.routed_prefill} prompts routed here{placed}, {host:.2f} ms host work per step")
    slos = f"{engine.slos.describe()}; " if engine.slos else ""
    return (f"Simulated engine: {slos}units (host work: the actors' own scheduling and recording, timed on this "
            "machine's CPU and left off the virtual clock): " + "; ".join(parts))


def _label(args: argparse.Namespace, target: Target, engine: Engine) -> str:
    where = target.hardware.name if target.hardware else "measured"
    return args.label or f"{target.shape.name} on {where}, {engine.mode} (simulated)"


def run(args: argparse.Namespace) -> int:
    """Simulate, print the summary as `pdserve bench` does, write the JSON; 0 when a request completed."""
    try:
        config = engine_config_from_args(args)
        options = loadtest.options_from_args(args)
        measured = read_summary(args.compare) if args.compare else None
        target = target_from_args(args, config)
        chat = None if args.model_shape else chat_overhead(resolve_model(config.model).path)
        simulation = simulate(config, target, options, options.workload.tokens_per_word, chat)
    except (ValueError, OSError) as error:
        print(f"pdserve simulate: error: {error}", file=sys.stderr)
        return 2
    except SimulationStalled as error:
        print(f"pdserve simulate: the simulated engine stopped serving: {error}", file=sys.stderr)
        return 1
    summary, engine = simulation.summary, simulation.engine
    label = _label(args, target, engine)
    print(format_summary(summary, options.percentiles, title=label))
    print(format_turns(summary))
    print(units_line(engine))
    if args.result_json:
        endpoint = EndpointConfig(f"simulate:{target.hardware.name if target.hardware else MEASURED}",
                                  target.shape.name, "chat" if options.workload.name in (MULTITURN, "edit")
                                  else "completions")
        write_json(args.result_json, result_document(label, endpoint, options.traffic, options.workload, summary,
                                                     simulation.result.records, arguments_dict(args)))
    if measured is not None:
        print(f"predicted (this simulation) vs measured ({args.compare}):")
        print(compare_table(summary, measured))
    return 0 if summary["completed"] else 1


def read_summary(path: str) -> dict:
    """The summary of a `pdserve bench --result-json` file; ValueError when it is not one."""
    try:
        summary = json.loads(Path(path).read_text())["summary"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"--compare {path}: not a pdserve bench --result-json file ({error})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"--compare {path}: its summary is not an object")
    return summary


COMPARED = ("request_throughput", "request_goodput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms", "p99_itl_ms", "median_short_itl_ms", "p99_short_itl_ms", "median_e2el_ms",
            "p99_e2el_ms", "prefix_cache_hit_rate")


def compare_table(predicted: dict, measured: dict, keys=COMPARED) -> str:
    """Predicted vs measured summary fields, with predicted / measured and whether it is within 25%."""
    lines = ["| field | predicted | measured | ratio | within 25% |", "|---|---:|---:|---:|---|"]
    for key in keys:
        p, m = predicted.get(key), measured.get(key)
        if p is None or m is None:
            continue
        ratio = p / m if m else float("inf") if p else 1.0
        lines.append(f"| {key} | {p:.2f} | {m:.2f} | {ratio:.2f}x | {'yes' if 0.75 <= ratio <= 1.25 else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
