"""How long pdserve takes to start: a first start on an empty cache folder (the GGUF converted, the native
kernels built, the start-up profile measured), a second start on the same folder (all of that kept), and a
one-prompt `pdserve generate` on the kept folder, each as a user runs it.

    python -m pdserve.bench.startup [--model smollm2] [--runs 3] [--out bench/out]

Each start is timed from the command to READY=1 (the systemd notification a unit waits for). Runs alternate
first and second starts. Writes OUT/startup.json and prints one line per run and the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve import env
from pdserve.bench.first_request import wait_ready

CLI = [sys.executable, "-m", "pdserve.server.cli"]


def serve_until_ready(model: str, cache: str, extra: list[str], timeout: float = 600.0) -> float:
    """Seconds from `pdserve serve` to its READY=1; the server is stopped after."""
    with tempfile.TemporaryDirectory() as tmp, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        notify = str(Path(tmp) / "notify")
        sock.bind(notify)
        sock.settimeout(1.0)
        variables = {**os.environ, "NOTIFY_SOCKET": notify, env.CACHE: cache}
        started = time.perf_counter()
        server = subprocess.Popen([*CLI, "serve", "--model", model, "--port", "0", "--log-level", "warning", *extra],
                                  env=variables)
        try:
            wait_ready(sock, server, timeout - (time.perf_counter() - started))
            return time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(timeout=60)


def generate_seconds(model: str, cache: str, extra: list[str]) -> float:
    """Wall seconds of `pdserve generate` of one short prompt."""
    started = time.perf_counter()
    subprocess.run([*CLI, "generate", "--model", model, "--max-tokens", "8", *extra, "Hello"], check=True,
                   env={**os.environ, env.CACHE: cache}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    p.add_argument("--extra", default="", help="more flags for serve and generate (engine options)")
    args = p.parse_args(argv)
    extra = args.extra.split()
    runs = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="pdserve-cache-") as cache:
            first = serve_until_ready(args.model, cache, extra)
            second = serve_until_ready(args.model, cache, extra)
            generate = generate_seconds(args.model, cache, extra)
        runs.append({"first_start_s": first, "second_start_s": second, "generate_s": generate})
        print(f"run {run + 1}: first start {first:.1f} s, second start {second:.1f} s, generate {generate:.1f} s")
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print("medians: " + ", ".join(f"{key} {value:.1f}" for key, value in medians.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps({"model": args.model, "runs": runs, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
