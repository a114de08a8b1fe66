"""`pdserve plan`: for a model, N devices of one kind, a workload and SLOs, simulate colocated data
parallelism, every xPyD split (fixed and adaptive), rank them by goodput and print the `pdserve serve`
command line of the best (docs/planning.md).

    pdserve plan --hardware h200 --devices 8 --model-shape llama-8b --dataset-name mixed \\
        --num-prompts 400 --request-rate 20 --slo ttft_ms=500 itl_ms=100
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.bench import loadtest
from pdserve.bench.sim_replay import ChatOverhead, chat_overhead
from pdserve.bench.simulate import Simulation, simulate
from pdserve.bench.multiturn import MULTITURN
from pdserve.bench.workloads import add_traffic_arguments, add_workload_arguments
from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.sim.clock import SimulationStalled
from pdserve.engine.sim.cost import DEFAULT_STEP_OVERHEAD_S, Roofline
from pdserve.engine.sim.target import Target
from pdserve.engine.sim.hardware import HARDWARE
from pdserve.engine.sim.shapes import NAMED_SHAPES

DEFAULT_SLO = ("ttft_ms=500", "itl_ms=100")   # a chat service's targets; state your own with --slo
PLACED = {"--mode", "--prefill-device", "--decode-device"}    # what a candidate decides


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str                        # colocated x8, 2P6D, adaptive 2P6D
    mode: str
    prefill_device: str
    decode_device: str | None

    def flags(self) -> list[str]:
        flags = ["--mode", self.mode, "--prefill-device", self.prefill_device]
        return flags + (["--decode-device", self.decode_device] if self.decode_device else [])


def candidates(devices: int) -> list[Candidate]:
    """Colocated on every device; with two or more, each split into x prefill and N - x decode devices,
    disaggregated and adaptive."""
    every = ",".join(f"cuda:{i}" for i in range(devices))
    found = [Candidate(f"colocated x{devices}", "colocated", every, None)]
    for x in range(1, devices):
        prefill = ",".join(f"cuda:{i}" for i in range(x))
        decode = ",".join(f"cuda:{i}" for i in range(x, devices))
        found += [Candidate(f"{x}P{devices - x}D", "disaggregated", prefill, decode),
                  Candidate(f"adaptive {x}P{devices - x}D", "adaptive", prefill, decode)]
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_workload_arguments(parser)
    add_traffic_arguments(parser)
    loadtest.add_metric_arguments(parser)
    g = parser.add_argument_group("plan")
    g.add_argument("--hardware", choices=sorted(HARDWARE), default="h200", help="the GPU every device is")
    g.add_argument("--devices", type=int, default=2, help="how many of them the deployment has")
    g.add_argument("--model-shape", choices=sorted(NAMED_SHAPES), default=None,
                   help="a published model shape, no weights needed (default: --model's config.json)")
    g.add_argument("--step-overhead-ms", type=float, default=DEFAULT_STEP_OVERHEAD_S * 1e3,
                   help="fixed host and launch time added to every simulated step")
    g.add_argument("--attainment", type=float, default=None, metavar="SHARE",
                   help="also find, for each placement, the highest request rate at which this share of requests "
                        "(e.g. 0.9) meets --slo (DistServe's goodput), and rank by it")


@dataclass(frozen=True, slots=True)
class Ranked:
    candidate: Candidate
    simulation: Simulation | None
    error: str = ""                  # why the candidate cannot run (e.g. the model does not fit a unit)
    max_rate: float | None = None    # --attainment: the highest rate meeting it


BRACKET_STEPS = 5    # doublings (or halvings) of --request-rate to bracket the highest rate: 32x either way
RATE_STEPS = 6       # bisections after that: the bracket to 1/64, finer than a run's own length moves goodput


def max_rate(attained: Callable[[float], bool], start: float) -> float:
    """The highest rate at which `attained(rate)`, assuming it holds below some rate and fails above: bracket
    it by doubling or halving from `start`, then bisect; 0 when even start / 2**BRACKET_STEPS fails."""
    if attained(start):
        low, high = start, None
        for _ in range(BRACKET_STEPS):
            if not attained(2 * low):
                high = 2 * low
                break
            low *= 2
        if high is None:
            return low
    else:
        low, high = start, start
        for _ in range(BRACKET_STEPS):
            low /= 2
            if attained(low):
                break
            high = low
        else:
            return 0.0
    for _ in range(RATE_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if attained(middle) else (low, middle)
    return low


def _attained(config: EngineConfig, target: Target, options: loadtest.Options, share: float,
              chat: ChatOverhead | None) -> Callable[[float], bool]:
    def attained(rate: float) -> bool:
        summary = simulate(config, target, sustained(options, rate), options.workload.tokens_per_word, chat).summary
        return (summary["slo_attainment"] or 0.0) >= share
    return attained


def sustained(options: loadtest.Options, rate: float) -> loadtest.Options:
    """`options` at `rate` over the arrival time they span at their own rate: more requests at a higher rate,
    so that a rate is judged held, not a fixed count absorbed as a burst."""
    scale = rate / options.traffic.request_rate
    traffic = replace(options.traffic, request_rate=rate,
                      num_prompts=max(1, math.ceil(options.traffic.num_prompts * scale)))
    workload = options.workload
    if workload.name == MULTITURN:
        workload = replace(workload, num_conversations=max(1, math.ceil(workload.num_conversations * scale)))
    return replace(options, traffic=traffic, workload=workload)


def rank(config: EngineConfig, target: Target, options: loadtest.Options, devices: int,
         chat: ChatOverhead | None = None, attainment: float | None = None) -> list[Ranked]:
    """Every candidate simulated, best first: the highest rate meeting `attainment` when given, then most
    goodput (within 1% counts as equal: a run's length moves it that much), then most headroom under the SLO,
    then tok/s; those that cannot run last."""
    runs, failed = [], []
    for candidate in candidates(devices):
        placed = replace(config, mode=candidate.mode, prefill_device=candidate.prefill_device,
                         decode_device=candidate.decode_device)
        try:
            simulation = simulate(placed, target, options, options.workload.tokens_per_word, chat)
            rate = None if attainment is None else max_rate(_attained(placed, target, options, attainment, chat),
                                                            options.traffic.request_rate)
            runs.append(Ranked(candidate, simulation, max_rate=rate))
        except (ValueError, SimulationStalled) as error:
            failed.append(Ranked(candidate, None, str(error)))
    if not runs:
        raise ValueError(f"no placement can run: {failed[0].error}")
    best = max(r.simulation.summary["request_goodput"] or 0.0 for r in runs) or 1.0
    return sorted(runs, key=lambda r: (-(r.max_rate or 0.0),
                                       -round((r.simulation.summary["request_goodput"] or 0.0) / best, 2),
                                       headroom(r.simulation.summary, options.slo),
                                       -r.simulation.summary["output_throughput"])) + failed


SLO_P99 = {"ttft": "p99_ttft_ms", "itl": "p99_itl_ms", "tpot": "p99_tpot_ms", "e2el": "p99_e2el_ms"}


def headroom(summary: dict, slo: dict[str, float]) -> float:
    """The p99 that comes closest to its SLO bound, as a share of the bound: among placements of equal
    goodput the one with the most room left (the lowest) ranks first."""
    return max((summary.get(SLO_P99[name], 0.0) / bound for name, bound in slo.items()), default=0.0)


def table(ranked: list[Ranked], attainment: float | None = None) -> str:
    searched = [f"max rate at {attainment:.0%} (req/s)"] if attainment is not None else []
    header = ["config", *searched, "goodput (req/s)", "within SLO", "output tok/s", "TTFT p50 / p99 (ms)",
              "ITL p50 / p99 (ms)"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for r in ranked:
        if r.simulation is None:
            lines.append(f"| {r.candidate.name} | cannot run: {r.error} |" + " |" * (len(header) - 2))
            continue
        s = r.simulation.summary
        rate = f" {r.max_rate:.2f} |" if searched else ""
        lines.append(f"| {r.candidate.name} |{rate} {s['request_goodput']:.2f} | {s['slo_attainment']:.0%} | "
                     f"{s['output_throughput']:.0f} | {s['median_ttft_ms']:.1f} / {s['p99_ttft_ms']:.1f} | "
                     f"{s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} |")
    return "\n".join(lines)


def serve_command(args: argparse.Namespace, candidate: Candidate) -> list[str]:
    """`pdserve serve` with the candidate's placement and every engine option given here that is not a default."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    command = ["pdserve", "serve", "--model", args.model or f"PATH/TO/{args.model_shape or 'MODEL'}"]
    for action in engine._actions:
        flag = action.option_strings[0] if action.option_strings else None
        value = getattr(args, action.dest, None)
        if flag is None or flag in PLACED or action.dest == "model" or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            command.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:
            command.append(flag)
        else:
            command += [flag, str(value)]
    return command + candidate.flags()


def engine_slos_from(args: argparse.Namespace, slo: dict[str, float]) -> None:
    """The engine plans toward the SLOs goodput is judged on: --ttft-slo-ms / --itl-slo-ms default to --slo's
    ttft_ms / itl_ms (so the recommended command carries them too)."""
    if args.ttft_slo_ms is None and "ttft" in slo:
        args.ttft_slo_ms = slo["ttft"]
    if args.itl_slo_ms is None and "itl" in slo:
        args.itl_slo_ms = slo["itl"]


def run(args: argparse.Namespace) -> int:
    """Rank the placements, print the table and the recommended command; 2 on bad options."""
    args.slo = args.slo or list(DEFAULT_SLO)
    try:
        engine_slos_from(args, loadtest.metric_options(args)[0])
        if args.devices < 1:
            raise ValueError("--devices must be at least 1")
        if args.step_overhead_ms < 0:
            raise ValueError("--step-overhead-ms must be non-negative")
        config = engine_config_from_args(args)
        options = loadtest.options_from_args(args)
        from pdserve.bench.simulate import model_shape

        shape = model_shape(args.model_shape, config.model)
        hardware = HARDWARE[args.hardware]
        target = Target(shape, Roofline(shape, hardware, overhead=args.step_overhead_ms / 1e3), hardware)
        chat = None if args.model_shape else chat_overhead(resolve_model(config.model).path)
        if args.attainment is not None and not (0 < args.attainment <= 1 and math.isfinite(args.request_rate)):
            raise ValueError("--attainment must be in (0, 1] and needs a finite --request-rate to search from")
        ranked = rank(config, target, options, args.devices, chat, args.attainment)
    except (ValueError, OSError) as error:
        print(f"pdserve plan: error: {error}", file=sys.stderr)
        return 2
    slo = " ".join(args.slo)
    print(f"{shape.name} on {args.devices} x {hardware.name} ({hardware.link}); goodput within {slo}; simulated")
    print(table(ranked, args.attainment))
    print("recommended: " + shlex.join(serve_command(args, ranked[0].candidate)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
