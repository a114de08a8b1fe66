"""Every `PDSERVE_*` environment variable pdserve reads, read here and nowhere else (README.md lists them).

A leaf module: it imports nothing of pdserve, so the kernels, the engine and the server can all use it.
Each accessor reads the environment when called, so a change (a test's monkeypatch) shows at once.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE = "PDSERVE_CACHE"
KERNELS = "PDSERVE_KERNELS"
API_KEY = "PDSERVE_API_KEY"
STEP_TRACE = "PDSERVE_STEP_TRACE"
FAULT = "PDSERVE_FAULT"
VLLM_API_KEY = "VLLM_API_KEY"           # read as vLLM reads it, for a pasted vLLM command line
NAMES = (CACHE, KERNELS, API_KEY, STEP_TRACE, FAULT)


def cache_dir() -> Path:
    """$PDSERVE_CACHE, else ~/.cache/pdserve: where generated demo checkpoints, converted GGUF files and the
    native kernels' builds are kept."""
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "pdserve")


def kernels_override() -> str:
    """$PDSERVE_KERNELS: "torch" or "triton" forces that kernel path for every op, "" (unset) lets each op
    choose; `pdserve.kernels.backend` rejects any other value."""
    return os.environ.get(KERNELS, "")


def api_key() -> str | None:
    """$PDSERVE_API_KEY, else vLLM's $VLLM_API_KEY: the default of `--api-key` (the bearer token /v1 requires);
    None when neither is set."""
    return os.environ.get(API_KEY) or os.environ.get(VLLM_API_KEY) or None


def step_trace_path() -> str | None:
    """$PDSERVE_STEP_TRACE: the file every actor appends one JSON line per finished step to; None (unset or
    empty) for no trace."""
    return os.environ.get(STEP_TRACE) or None


def fault_spec(environ: Mapping[str, str] | None = None) -> str | None:
    """$PDSERVE_FAULT (in `environ`, default this process's environment): the supervisor tests' fault hook,
    "<unit>:<kind>@<step>" (parsed by `pdserve.engine.worker.faults`); None when unset or empty."""
    return (os.environ if environ is None else environ).get(FAULT) or None
