"""`python -m pdserve.bench.compare`: pdserve adaptive vs disaggregated vs colocated vs `transformers serve`.

Starts each server on a free local port with the same checkpoint, runs the same
seeded workload against each in turn, stops it (SIGTERM, SIGKILL after a grace
period) whatever happens, and writes a Markdown report (side-by-side table,
targets, server commands) to the file `--report` names, a JSON file and one
combined plot; by default all three go to the ignored bench/out/, and the run
prints where. It never writes bench/RESULTS.md: that page is edited by hand
with the figures that answer a question. A server that cannot start or serve
is reported as failed with the reason.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from pdserve import env
from pdserve.bench import loadtest
from pdserve.bench.compare_report import evaluate_targets, render_report, roles_plot_path, write_report
from pdserve.bench.documents import arguments_dict, machine_description, write_json
from pdserve.bench.metrics import BenchResult, markdown_comparison
from pdserve.bench.server_metrics import PlacementSampler
from pdserve.bench.servers import (
    KV_TIERS_AB,
    KV_TIERS_POOL,
    OPTIONAL_SERVERS,
    PREFIX_CACHING_AB,
    REPO,
    SERVER_NAMES,
    LlamaCppSetup,
    ManagedServer,
    ServerOutcome,
    ServerSpec,
    default_model_dir,
    display_command,
    free_port,
    parse_variant,
    server_specs,
    variant_specs,
)
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.turn_metrics import markdown_turns
from pdserve.bench.workloads import add_traffic_arguments, add_workload_arguments

OUT_DIR = REPO / "bench" / "out"  # ignored by git: a run's report, JSON, plots and server logs
RESULTS_PAGE = REPO / "bench" / "RESULTS.md"  # the hand-kept results page, never written here


def _step_trace(spec: ServerSpec, args: argparse.Namespace, log_dir: Path) -> dict[str, str]:
    """With --step-trace, a pdserve server writes a line per step (PDSERVE_STEP_TRACE) to LOG_DIR/NAME.steps.jsonl,
    started empty (another server ignores the variable)."""
    if not args.step_trace:
        return {}
    path = log_dir / f"{spec.name}.steps.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return {env.STEP_TRACE: str(path)}


def run_server(spec: ServerSpec, args: argparse.Namespace, options: loadtest.Options,
               log_dir: Path) -> ServerOutcome:
    """Start `spec`, benchmark it, stop it; every failure becomes the outcome's error."""
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in spec.argv]
    command = display_command(argv)
    if spec.unavailable:
        return ServerOutcome(spec, command, error=spec.unavailable)
    print(f"--- {spec.title}: {command}", file=sys.stderr)
    started = time.monotonic()
    with ManagedServer(argv, log_dir / f"{spec.name}.log", spec.env | _step_trace(spec, args, log_dir),
                       args.stop_grace) as server:
        base_url = f"http://127.0.0.1:{port}"
        try:
            model = server.wait_ready(base_url, args.server_timeout)
        except RuntimeError as error:
            return ServerOutcome(spec, command, error=str(error))
        startup = time.monotonic() - started
        result, timeline = asyncio.run(_benchmark(spec, base_url, model, args, options))
    summary = loadtest.summarize_run(result, options)
    error = "" if summary["completed"] else f"no request succeeded: {summary['errors']}"
    return ServerOutcome(spec, command, error, startup, summary, result.records, tuple(timeline))


async def _benchmark(spec: ServerSpec, base_url: str, model: str, args: argparse.Namespace,
                     options: loadtest.Options) -> tuple[BenchResult, list[dict]]:
    """The run's result and the server's placement timeline over it (`PlacementSampler`; [] without one)."""
    endpoint = EndpointConfig(base_url=base_url, model=model, endpoint=args.endpoint,
                              length_control=spec.length_control, temperature=args.temperature,
                              require_done=spec.require_done, request_timeout=args.request_timeout)
    endpoint = loadtest.workload_endpoint(endpoint, options.workload)
    async with PlacementSampler(endpoint, args.role_interval) as sampler:
        result = await loadtest.run_workload(endpoint, options, progress=not args.disable_tqdm)
    return result, sampler.timeline(result.origin)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `python -m pdserve.bench.compare` flags (workload and traffic flags as in `pdserve bench`)."""
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo 'base' model)")
    parser.add_argument("--servers", default=None, help=f"comma list from {', '.join(SERVER_NAMES + OPTIONAL_SERVERS)} "
                                                         "(default: the first four, none with --pdserve-variant or "
                                                         "--prefix-caching-ab)")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server for --servers llama.cpp "
                                                              "(default: on PATH)")
    parser.add_argument("--llama-gguf", default=None, help="GGUF of the same weights, for --servers llama.cpp")
    parser.add_argument("--llama-kv-type", default="f32", help="llama.cpp's -ctk/-ctv (f32 matches pdserve float32)")
    parser.add_argument("--llama-slots", type=int, default=16, help="llama.cpp's -np (parallel sequences)")
    parser.add_argument("--pdserve-variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="also run a pdserve server named NAME with these extra flags (repeatable), e.g. "
                             "--pdserve-variant big-blocks='--block-size 32'")
    parser.add_argument("--prefix-caching-ab", action="store_true",
                        help="pdserve with --enable-prefix-caching against --no-enable-prefix-caching, by default on "
                             "the multiturn workload, as the run 'prefix-caching'")
    parser.add_argument("--kv-tiers-ab", action="store_true",
                        help="pdserve with KV tiers (--kv-offload-memory, --kv-offload-disk in a fresh folder) against "
                             "without, both with prefix caching, by default on the multiturn workload with a pool "
                             f"it does not fit ({KV_TIERS_POOL}, unless --pdserve-args is given), as the run 'kv-tiers'")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds for a server to become ready")
    parser.add_argument("--stop-grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--pdserve-args", default="", help="extra flags for both pdserve servers, one string")
    parser.add_argument("--transformers-args", default="", help="extra flags for transformers serve, one string")
    add_workload_arguments(parser)
    add_traffic_arguments(parser)
    loadtest.add_metric_arguments(parser)
    parser.set_defaults(num_prompts=40, request_rate=2.0, short_input_len=64, long_input_len=1024, output_len=32,
                        long_fraction=0.1, num_warmups=2, num_conversations=12, system_prompt_len=256,
                        user_message_len=32)
    parser.add_argument("--report", default=None,
                        help="Markdown report of the run (replaced if it exists; default: bench/out/compare.md, "
                             "compare_SECTION.md for another --section)")
    parser.add_argument("--result-json", default=None,
                        help="default: as --report, .json")
    parser.add_argument("--plot", default=None, help="default: as --report, .png; the pdserve servers' "
                                                     "actor roles over time go beside it, as NAME_roles.png")
    parser.add_argument("--role-interval", type=float, default=0.25,
                        help="seconds between two reads of a server's /metrics for its role timeline")
    parser.add_argument("--log-dir", default=str(OUT_DIR / "logs"), help="one server log per server")
    parser.add_argument("--step-trace", action="store_true",
                        help="each pdserve server writes one line per step to LOG_DIR/NAME.steps.jsonl "
                             "(PDSERVE_STEP_TRACE: unit, threads, work, compute seconds; for finding where time goes)")
    parser.add_argument("--section", default=None,
                        help="name of this run: the report's title and the default file names (e.g. one per "
                             "workload; default: 'default', 'prefix-caching' with --prefix-caching-ab)")
    parser.add_argument("--disable-tqdm", action="store_true")


def _write_outputs(args: argparse.Namespace, options: loadtest.Options, model_dir: str,
                   outcomes: list[ServerOutcome], command: str) -> None:
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    write_json(args.result_json, {
        "command": command, "date": date, "machine": machine_description(), "model": model_dir,
        "workload": asdict(options.workload), "traffic": asdict(options.traffic),
        "targets": dict(evaluate_targets(outcomes, options)),
        "servers": [{"name": o.spec.name, "title": o.spec.title, "command": o.command, "ok": o.ok, "error": o.error,
                     "startup_s": o.startup_s, "summary": o.summary, "requests": [r.to_json() for r in o.records],
                     "role_timeline": list(o.timeline)}
                    for o in outcomes],
    } | {"arguments": arguments_dict(args)})
    runs = [(o.spec.title, o.records) for o in outcomes if o.records]
    timelines = [(o.spec.title, o.timeline, o.records) for o in outcomes if o.timeline]
    if runs:
        from pdserve.bench.plot import plot_runs

        plot_runs(runs, args.plot)
    if timelines:
        from pdserve.bench.plot import plot_roles

        plot_roles(timelines, roles_plot_path(args.plot))
    write_report(Path(args.report), render_report(args, options, model_dir, outcomes, command, date))


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """In the main thread, SIGTERM raises KeyboardInterrupt, so servers are stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Benchmark each server in turn and write the report; `argv` (default sys.argv[1:]) is
    the command line recorded in it.

    Returns 0 when every server served, 1 when any failed, 2 on invalid flags, 130 on Ctrl-C
    or SIGTERM (servers are stopped in every case).
    """
    if Path(args.report).resolve() == RESULTS_PAGE.resolve():
        print(f"pdserve.bench.compare: error: --report {args.report} is the hand-kept results page; name another file "
              "and copy the figures that answer a question into the page", file=sys.stderr)
        return 2
    model_dir = args.model or default_model_dir()
    if args.tokenizer is None and (Path(model_dir) / "tokenizer.json").is_file():
        args.tokenizer = model_dir  # size prompts in the served model's tokens
    try:
        options = loadtest.options_from_args(args)
        specs = selected_specs(args, model_dir)
    except (ValueError, OSError) as error:
        print(f"pdserve.bench.compare: error: {error}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "pdserve.bench.compare", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_comparison(specs, args, options, model_dir, command)
    finally:
        if args.kv_tiers_ab:
            shutil.rmtree(args.kv_tiers_folder, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `python -m pdserve.bench.compare` flags of `argv` (default sys.argv[1:]), presets applied."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.compare", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    _apply_presets(args)
    return args


def _apply_presets(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on --prefix-caching-ab (its two servers, workload and section) and the
    output paths: --report under bench/out/, the JSON and plot beside it."""
    ab = args.prefix_caching_ab or args.kv_tiers_ab
    if args.prefix_caching_ab:
        args.pdserve_variant = [f"{name}={flags}" for name, flags in PREFIX_CACHING_AB] + args.pdserve_variant
    if args.kv_tiers_ab:
        folder = args.kv_tiers_folder = tempfile.mkdtemp(prefix="pdserve-kv-tiers-")   # NOTE: a cold disk tier
        args.pdserve_variant = [f"{name}={flags.format(folder=folder)}" for name, flags in KV_TIERS_AB] + \
            args.pdserve_variant
        args.pdserve_args = args.pdserve_args or KV_TIERS_POOL
    if args.servers is None:
        args.servers = "" if args.pdserve_variant else ",".join(SERVER_NAMES)
    args.dataset_name = args.dataset_name or ("multiturn" if ab else "mixed")
    args.section = args.section or ("kv-tiers" if args.kv_tiers_ab else "prefix-caching" if ab else "default")
    stem = "compare" if args.section == "default" else "compare_" + re.sub(r"[^A-Za-z0-9]+", "_", args.section)
    args.report = args.report or str(OUT_DIR / f"{stem}.md")
    args.result_json = args.result_json or str(Path(args.report).with_suffix(".json"))
    args.plot = args.plot or str(Path(args.report).with_suffix(".png"))


def selected_specs(args: argparse.Namespace, model_dir: str) -> list[ServerSpec]:
    """The servers --servers and --pdserve-variant name, in that order; ValueError on bad names or none."""
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    variants = [parse_variant(text) for text in args.pdserve_variant]
    if set(names) - set(SERVER_NAMES + OPTIONAL_SERVERS):
        raise ValueError(f"--servers must name some of {', '.join(SERVER_NAMES + OPTIONAL_SERVERS)}")
    if not names and not variants:
        raise ValueError("no server to run: give --servers, --pdserve-variant or --prefix-caching-ab")
    if len({name for name, _ in variants}) < len(variants):
        raise ValueError("two --pdserve-variant servers have the same name")
    pdserve_args = shlex.split(args.pdserve_args)
    llama = LlamaCppSetup(args.llama_server, args.llama_gguf, kv_type=args.llama_kv_type, slots=args.llama_slots)
    return (server_specs(model_dir, names, pdserve_args, shlex.split(args.transformers_args), llama)
            + variant_specs(model_dir, variants, pdserve_args))


def run_comparison(specs: list[ServerSpec], args: argparse.Namespace, options: loadtest.Options,
                   model_dir: str, command: str) -> int:
    """Run every server in `specs` one after the other, write the report, JSON and plot, print the table and
    where the files went."""
    try:
        with _sigterm_as_interrupt():
            outcomes = [run_server(spec, args, options, Path(args.log_dir)) for spec in specs]
    except KeyboardInterrupt:
        print("pdserve.bench.compare: interrupted; servers stopped", file=sys.stderr)
        return 130
    _write_outputs(args, options, model_dir, outcomes, command)
    print(markdown_comparison([(o.spec.title, o.summary, o.startup_s) for o in outcomes]))
    print(markdown_turns([(o.spec.title, o.summary) for o in outcomes]))
    print("\n".join(f"{what}: {verdict}" for what, verdict in evaluate_targets(outcomes, options)))
    print("\n".join(f"{o.spec.title} failed: {o.error}" for o in outcomes if not o.ok))
    plot = f"; plot {args.plot}" if any(o.records for o in outcomes) else ""
    print(f"pdserve.bench.compare: report {args.report}; per-request data {args.result_json}{plot}")
    return 0 if all(o.ok for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.bench.compare`: parse `argv` (default sys.argv[1:]) and run."""
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
