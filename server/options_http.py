"""`pdserve serve` options for the HTTP side: CORS, TLS and the HTTP logs (vLLM's names and meanings)."""
from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import Any

import orjson

from pdserve.server.config import CorsConfig, TlsConfig

UVICORN_LOG_LEVELS = {"critical": "critical", "error": "error", "warning": "warning", "info": "info",
                      "debug": "debug", "trace": "debug"}


def add_http_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("http")
    g.add_argument("--allowed-origins", type=_names, default=None, metavar="ORIGINS",
                   help="origins whose browser pages may call the API (CORS): a JSON list as vLLM takes it, or "
                        "comma-separated; [\"*\"]: any (default: none, same-origin only)")
    g.add_argument("--allowed-methods", type=_names, default=("*",), metavar="METHODS",
                   help="with --allowed-origins: the methods a cross-origin request may use (default: any)")
    g.add_argument("--allowed-headers", type=_names, default=("*",), metavar="HEADERS",
                   help="with --allowed-origins: the headers a cross-origin request may send (default: any)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="with --allowed-origins: let cross-origin requests carry cookies and credentials")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="the certificate's private key (PEM; default: inside --ssl-certfile)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates that client certificates are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                   help="client certificates: 0 not asked for (default), 1 optional, 2 required (Python's ssl)")
    g.add_argument("--uvicorn-log-level", choices=tuple(UVICORN_LOG_LEVELS), default=None,
                   help="level of the HTTP server's logs and the access log (trace: debug) (default: --log-level)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM command lines; pdserve never logs prompts or outputs")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted for vLLM command lines; pdserve logs no periodic statistics (see /metrics)")


def http_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig fields; raises ValueError naming the option."""
    level = args.uvicorn_log_level
    return dict(cors=_cors(args), tls=_tls(args), access_log=not args.disable_uvicorn_access_log,
                http_log_level=UVICORN_LOG_LEVELS[level] if level else None)


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A server context for `tls`; raises ValueError naming the file that cannot be used."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile)
        if tls.ca_certs:
            context.load_verify_locations(tls.ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot use --ssl-certfile {tls.certfile} / --ssl-keyfile {tls.keyfile}"
                         f"{' / --ssl-ca-certs ' + tls.ca_certs if tls.ca_certs else ''}: {e}") from None
    context.verify_mode = ssl.VerifyMode(tls.cert_reqs)
    return context


def _cors(args: argparse.Namespace) -> CorsConfig | None:
    if args.allowed_origins is None:
        if args.allow_credentials:
            raise ValueError("--allow-credentials needs --allowed-origins")
        return None
    return CorsConfig(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    if args.ssl_certfile is None:
        if args.ssl_keyfile or args.ssl_ca_certs or args.ssl_cert_reqs:
            raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
        return None
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs to check client certificates against")
    tls = TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    for name in ("certfile", "keyfile", "ca_certs"):
        if (path := getattr(tls, name)) is not None and not Path(path).is_file():
            raise ValueError(f"--ssl-{name.replace('_', '-')} {path}: no such file")
    ssl_context(tls)                                  # NOTE: a bad file stops the start, not the first request
    return tls


def _names(text: str) -> tuple[str, ...]:
    """A JSON list of strings (vLLM's form) or a comma-separated list."""
    if text.lstrip().startswith("["):
        try:
            names = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise argparse.ArgumentTypeError("expected a JSON list of non-empty strings")
        return tuple(names)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected at least one name")
    return names
