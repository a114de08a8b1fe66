"""A disk KV tier across a SIGKILL or a clean stop: the first token of prompts whose blocks reached the tier before
it, on the restarted server, against a fresh server without a tier (the target: at most 0.3x), with the same tokens.

    python -m pdserve.bench.tier_restart [--stop kill|term]

Demo base model in float32 with a 64 MiB pool: sixteen 120-word prompts fill it past its size, so the first ones are
evicted to the disk tier. `kill`: the server is killed (SIGKILL) and started again on the same folder, and the
first three are asked again (a block still in the pool at a kill is not on disk). `term`: it is stopped as systemd
stops it (SIGTERM), which writes what the pool still holds, and the last three, never evicted, are asked again.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from pdserve.bench.servers import free_port
from pdserve.engine.model.demo import default_model_dir

POOL = ["--dtype", "float32", "--kv-cache-memory", "64MiB"]
WORDS = "river stone light paper window garden music silver cloud morning".split()


def start(model: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pdserve.server.cli", "serve", "--model", model, "--port", str(port),
                               *POOL, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server, port
        except OSError:
            time.sleep(0.5)


def first_token(port: int, prompt: str) -> tuple[float, str]:
    """Seconds to the first streamed token of a greedy 8-token completion, and its text."""
    base = f"http://127.0.0.1:{port}/v1"
    name = json.load(urllib.request.urlopen(base + "/models"))["data"][0]["id"]
    body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    request = urllib.request.Request(base + "/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    started, first, text = time.perf_counter(), None, ""
    with urllib.request.urlopen(request) as response:
        for line in response:
            if line.startswith(b"data: {"):
                first = first or time.perf_counter() - started
                text += json.loads(line[6:])["choices"][0]["text"]
    return first, text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stop", choices=("kill", "term"), default="kill")
    args = p.parse_args(argv)
    model, folder = str(default_model_dir("base")), tempfile.mkdtemp(prefix="pdserve-tier-restart-")
    rng = random.Random(7)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(120)) + f" question {i}:" for i in range(16)]
    tier = ["--kv-offload-disk", f"{folder}:2GiB"]
    try:
        server, port = start(model, tier)
        cold = [first_token(port, p) for p in prompts]
        server.send_signal(signal.SIGKILL if args.stop == "kill" else signal.SIGTERM)
        server.wait()
        asked = slice(0, 3) if args.stop == "kill" else slice(-3, None)
        server, port = start(model, tier)
        kept = [first_token(port, p) for p in prompts[asked]]
        server.terminate()
        server.wait()
        server, port = start(model, [])
        fresh = [first_token(port, p) for p in prompts[asked]]
        server.terminate()
        server.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stop = "SIGKILL" if args.stop == "kill" else "SIGTERM"
    for name, runs in ((f"before the {stop}, tier empty", cold[asked]), (f"after the {stop}, from the disk tier", kept),
                       ("fresh server, no tier", fresh)):
        print(f"{name}: first token {[round(t * 1e3) for t, _ in runs]} ms")
    same = all(k[1] == c[1] == f[1] for k, c, f in zip(kept, cold[asked], fresh))
    ratio = statistics.median(t for t, _ in kept) / statistics.median(t for t, _ in fresh)
    print(f"same tokens: {same}; after the {stop} / fresh, medians: {ratio:.3f}x (target <= 0.3x: "
          f"{'met' if ratio <= 0.3 and same else 'NOT met'})")


if __name__ == "__main__":
    main()
