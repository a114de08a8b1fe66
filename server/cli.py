"""`pdserve`: serve (the default), systemd-unit, generate, chat, make-model, bench, simulate, plan."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.server.options import add_serve_arguments, server_config_from_args

__all__ = ["COMMANDS", "add_serve_arguments", "main", "server_config_from_args"]


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False        # unknown options are kept in `args.passthrough`, not rejected


def run_serve(args: argparse.Namespace) -> int:
    from pdserve.server.serve import run

    config = server_config_from_args(args)                # NOTE: a ValueError here exits 2, naming the option
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("aiohttp", "pdserve.server.access"):
        logging.getLogger(name).setLevel((config.http_log_level or config.log_level).upper())
    try:
        return run(config)
    except (ValueError, FileNotFoundError, OSError) as e:
        logging.getLogger("server").error("cannot serve: %s", e)
        return 1


def add_unit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--unit-user", default=None, help="User= of the service (default: DynamicUser=yes)")
    parser.add_argument("--unit-description", default=None)
    parser.add_argument("--watchdog-sec", type=int, default=30, help="WatchdogSec= (0 disables)")


def run_systemd_unit(args: argparse.Namespace) -> int:
    from pdserve.server.systemd import render_unit
    from pdserve.server.systemd_paths import service_paths, unreadable

    serve_parser = argparse.ArgumentParser(prog="pdserve systemd-unit")
    add_serve_arguments(serve_parser)
    serve_args = serve_parser.parse_args(args.passthrough)
    config = server_config_from_args(serve_args)
    ray = serve_args.distributed_executor_backend == "ray"
    problem = unreadable(service_paths(config.engine.model), args.unit_user, private_tmp=not ray)
    if problem is not None:
        print(f"pdserve systemd-unit: the unit could not start: {problem}", file=sys.stderr)
        return 2
    if "--api-key" in args.passthrough:
        print("note: the API key is written into the unit; prefer PDSERVE_API_KEY in /etc/pdserve/env",
              file=sys.stderr)
    if ray and args.unit_user is None:
        print("note: the Ray node's session belongs to the user that ran `ray start`; pass --unit-user NAME",
              file=sys.stderr)
    writable = tier_folders(serve_args)
    for folder in writable:
        print(f"note: the disk KV tier's folder {folder} must exist and be writable by the service's user",
              file=sys.stderr)
    sys.stdout.write(render_unit(args.passthrough, user=args.unit_user, description=args.unit_description,
                                 shutdown_timeout=serve_args.shutdown_timeout, watchdog_sec=args.watchdog_sec,
                                 ray=ray, writable=writable))
    return 0


def tier_folders(serve_args: argparse.Namespace) -> list[str]:
    """The disk tier's folder when the options name one (without a PATH it is the unit's cache folder)."""
    text = serve_args.kv_offload_disk
    if text is None or ":" not in text:
        return []
    return [str(Path(text.rpartition(":")[0]).expanduser().absolute())]


def _engine_cli():
    from pdserve.engine import cli

    return cli


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    _engine_cli().add_generate_arguments(parser)


def _chat_repl():
    from pdserve.server import chat_repl

    return chat_repl


def _loadtest():
    from pdserve.bench import loadtest

    return loadtest


def _simulate():
    from pdserve.bench import simulate

    return simulate


def _plan():
    from pdserve.bench import plan

    return plan


COMMANDS = {
    "serve": Command("run the OpenAI-compatible server (the default)", add_serve_arguments, run_serve),
    "systemd-unit": Command("print a systemd unit that serves with the given options (any `pdserve serve` "
                            "option is accepted and goes into ExecStart)", add_unit_arguments, run_systemd_unit,
                            passthrough=True),
    "generate": Command("offline generation for prompts given or read from stdin", _add_generate_arguments,
                        lambda a: _engine_cli().run_generate(a)),
    "chat": Command("chat with a running server in the terminal, answers streamed",
                    lambda p: _chat_repl().add_arguments(p), lambda a: _chat_repl().run(a)),
    "make-model": Command("write the demo checkpoint into a directory",
                          lambda p: _engine_cli().add_make_model_arguments(p),
                          lambda a: _engine_cli().run_make_model(a)),
    "bench": Command("load-test an OpenAI-compatible streaming endpoint",
                     lambda p: _loadtest().add_arguments(p), lambda a: _loadtest().run(a)),
    "simulate": Command("predict what `pdserve bench` would measure: the workload through the engine's own "
                        "coordinator and actors on a virtual clock, step times from a cost model",
                        lambda p: _simulate().add_arguments(p), lambda a: _simulate().run(a)),
    "plan": Command("rank colocated, every xPyD split and adaptive placement on N GPUs by simulated goodput, "
                    "and print the `pdserve serve` command of the best", lambda p: _plan().add_arguments(p),
                    lambda a: _plan().run(a)),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "serve")
    if argv[0] not in COMMANDS:
        _top_level_parser().parse_args(argv)          # prints help, or exits 2 on an unknown command
        return 2
    command = COMMANDS[argv[0]]
    parser = argparse.ArgumentParser(prog=f"pdserve {argv[0]}", description=command.help)
    command.add_arguments(parser)
    if command.passthrough:
        args, args.passthrough = parser.parse_known_args(argv[1:])
    else:
        args = parser.parse_args(argv[1:])
    try:
        return command.run(args)
    except ValueError as e:
        parser.error(str(e))


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM inference server. "
                                     "With no command (or options only), runs `serve`.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        commands.add_parser(name, help=command.help)
    return parser


if __name__ == "__main__":
    sys.exit(main())
