"""Time to first token of the first requests after the server reports READY=1 (no compile stall).

    python -m pdserve.bench.first_request [--device cuda:0] [--model demo:base] [--requests 10] [--out DIR]

Starts `pdserve serve` with an empty Triton cache and a NOTIFY_SOCKET of its own, waits for READY=1,
then at once sends `--requests` streaming completions one after another, of varied prompt lengths;
the first and the last have the same length. Target: the first request's TTFT within 2x of the
last's (kernels compiled on the first request would cost seconds). Writes DIR/first_request.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from pdserve.bench.sse_client import EndpointConfig, send_request
from pdserve.bench.workloads import SampleRequest

TARGET_RATIO = 2.0
WORDS = "the of and a to in is you that it he was for on are as with his they I at be this have from".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, notify: str, triton_cache: str) -> subprocess.Popen:
    env = {**os.environ, "NOTIFY_SOCKET": notify, "TRITON_CACHE_DIR": triton_cache}
    command = [sys.executable, "-m", "pdserve.server.cli", "serve", "--model", args.model, "--port", str(port),
               "--prefill-device", args.device, "--decode-device", args.device, "--log-level", "warning",
               "--served-model-name", "pdserve"]
    return subprocess.Popen(command + (["--mode", args.mode] if args.mode else []), env=env)


def wait_ready(sock: socket.socket, server: subprocess.Popen, timeout: float) -> float:
    """Seconds until READY=1 arrived; RuntimeError when the server exits or the timeout passes first."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before READY=1")
        try:
            if b"READY=1" in sock.recv(4096):
                return time.perf_counter() - started
        except TimeoutError:
            continue
    raise RuntimeError(f"no READY=1 within {timeout:g} s")


def samples(count: int, seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)
    lengths = [300] + [rng.choice([1, 5, 40, 129, 700, 1500, 64, 17]) for _ in range(count - 2)] + [300]
    return [SampleRequest(" ".join(rng.choice(WORDS) for _ in range(n)), n, 16, "short") for n in lengths]


async def first_tokens(port: int, requests: list[SampleRequest]) -> list[dict]:
    endpoint = EndpointConfig(base_url=f"http://127.0.0.1:{port}", model="pdserve", temperature=0.0)
    records = []
    async with aiohttp.ClientSession() as session:
        for index, sample in enumerate(requests):
            record = await send_request(session, endpoint, sample, index, time.perf_counter())
            records.append({"words": sample.prompt_len, "ttft_ms": record.ttft * 1e3, "ok": record.success,
                            "error": record.error})
    return records


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        notify = str(Path(tmp) / "notify")
        sock.bind(notify)
        sock.settimeout(1.0)
        server = start_server(args, port, notify, str(Path(tmp) / "triton"))
        try:
            ready = wait_ready(sock, server, args.ready_timeout)
            records = asyncio.run(first_tokens(port, samples(args.requests, args.seed)))
        finally:
            server.terminate()
            server.wait(timeout=60)
    first, last = records[0]["ttft_ms"], records[-1]["ttft_ms"]
    ratio = first / last if last > 0 else float("inf")
    return {"device": args.device, "model": args.model, "ready_seconds": ready, "requests": records,
            "first_over_last": ratio, "target_ratio": TARGET_RATIO,
            "meets_target": all(r["ok"] for r in records) and ratio <= TARGET_RATIO}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="demo:base")
    p.add_argument("--mode", default=None, choices=("colocated", "disaggregated"))
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    args = p.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_request.json").write_text(json.dumps(result, indent=2))
    ttfts = ", ".join(f"{r['ttft_ms']:.1f}" for r in result["requests"])
    print(f"READY after {result['ready_seconds']:.1f} s; TTFT ms of requests 1..{args.requests}: {ttfts}")
    print(f"first / last = {result['first_over_last']:.2f} (target <= {TARGET_RATIO:g}): "
          f"{'ok' if result['meets_target'] else 'MISS'}")
    return 0 if all(r["ok"] for r in result["requests"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
