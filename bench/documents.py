"""What a benchmark run writes: the --result-json document, the machine it ran on, strict JSON."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.workloads import TrafficSpec, WorkloadSpec


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def arguments_dict(args: argparse.Namespace) -> dict:
    """The parsed flags as plain values (callables, e.g. a subcommand handler, left out)."""
    plain = (str, int, float, bool, list, dict, type(None))
    return {k: v if isinstance(v, plain) else str(v) for k, v in vars(args).items() if not callable(v)}


def result_document(label: str, endpoint: EndpointConfig, traffic: TrafficSpec, workload: WorkloadSpec,
                    summary: dict, records: Iterable[RequestRecord], arguments: dict) -> dict:
    """The --result-json document: run description, summary, every request."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "label": label,
        "base_url": endpoint.base_url,
        "model": endpoint.model,
        "endpoint": endpoint.endpoint,
        "workload": asdict(workload),
        "traffic": asdict(traffic),
        "arguments": arguments,
        "summary": summary,
        "requests": [record.to_json() for record in records],
    }


def machine_description() -> str:
    """CPU model, core counts, OS and the versions that matter, in one line."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {os.cpu_count()} cores ({usable} usable), torch CPU capability {_cpu_capability()}, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {_version('torch')}, transformers {_version('transformers')}")


def _cpu_capability() -> str:
    """torch's name for the widest vector ISA it dispatches to here (AVX512, AVX2, ...)."""
    try:
        import torch
    except ImportError:
        return "unknown (no torch)"
    return torch.backends.cpu.get_cpu_capability()


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def write_json(path: str | Path, document: dict) -> None:
    """Write `document` as strict JSON (inf and nan become strings), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(document), indent=1, allow_nan=False) + "\n", encoding="utf-8")
