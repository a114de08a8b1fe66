"""The options of `pdserve serve` and the ServerConfig they make."""
from __future__ import annotations

import argparse
from dataclasses import replace

from pdserve import env
from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.worker.memory import parse_memory
from pdserve.server.config import METRICS_NAMES, RequestLimits, ServerConfig
from pdserve.server.options_chat import add_chat_args, chat_options_from_args
from pdserve.server.options_http import add_http_args, http_options_from_args

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULTS = ServerConfig()
LIMITS = RequestLimits()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="model name(s) the API accepts; the first is the one reported (default: the "
                        "model's own name, e.g. smollm2, and the --model value)")
    g.add_argument("--api-key", default=env.api_key(),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $PDSERVE_API_KEY, else $VLLM_API_KEY)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the random generator that requests without a seed sample from (vLLM's default 0)")
    g.add_argument("--max-body-bytes", type=_bytes, default=DEFAULTS.max_body_bytes,
                   help="largest request body, e.g. 8MiB (413 above)")
    g.add_argument("--max-n", type=int, default=LIMITS.max_n, help="largest `n` a request may ask for")
    g.add_argument("--max-total-tokens-per-request", type=int, default=LIMITS.max_total_tokens, metavar="N",
                   help="largest n x max_tokens (over every prompt) of one request; 400 above it, and the cap "
                        "on a request without max_tokens")
    g.add_argument("--allow-client-priority", action="store_true",
                   help="honour the `priority` field of requests (default: validated, then ignored)")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULTS.shutdown_timeout,
                   help="seconds SIGTERM waits for running streams before aborting them")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    g.add_argument("--metrics-names", choices=METRICS_NAMES, default="both",
                   help="the names /metrics exports: vLLM's (vllm:*, for its Grafana dashboard and llm-d's "
                        "endpoint picker), pdserve's (pdserve_*) or both (default)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    add_engine_args(parser)
    add_server_args(parser)
    add_chat_args(parser)
    add_http_args(parser)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError naming the option for an invalid value."""
    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be in [0, 65535]")
    if min(args.max_n, args.max_body_bytes, args.max_total_tokens_per_request) < 1:
        raise ValueError("--max-n, --max-body-bytes and --max-total-tokens-per-request must be positive")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be non-negative")
    engine = replace(engine_config_from_args(args), model=_model(args), seed=args.seed)
    return ServerConfig(engine=engine, host=args.host, port=args.port,
                        served_model_names=tuple(args.served_model_name), api_key=args.api_key or None,
                        max_body_bytes=args.max_body_bytes, limits=_limits_from_args(args),
                        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                        metrics_names=args.metrics_names, **chat_options_from_args(args),
                        **http_options_from_args(args))


def _model(args: argparse.Namespace) -> str | None:
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}; give one")
    return args.model_tag or args.model


def _limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(max_n=args.max_n, max_total_tokens=args.max_total_tokens_per_request,
                         allow_client_priority=args.allow_client_priority)


def _bytes(text: str) -> int:
    try:
        size, _ = parse_memory(text)
    except ValueError:
        size = None
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size in bytes, e.g. 1048576 or 8MiB")
    return size
