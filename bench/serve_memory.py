"""Peak resident memory of `pdserve serve` against llama.cpp's `llama-server` on the same GGUF and KV size,
and where each one's memory goes.

    python -m pdserve.bench.serve_memory --model FILE.gguf --llama-server BIN --context 4096 --threads 2

llama-server gets `-c CONTEXT` (its default f16 K/V); pdserve gets `--kv-cache-memory` of exactly those
bytes (2 x layers x KV heads x head size x CONTEXT x 2: its bfloat16 pool holds as many tokens) and its
defaults otherwise. Each server is started in turn (pdserve once before, untimed, so that the GGUF's
conversion and block cache are built: a first start is not what this measures), sent `--requests`
completions, and then read from /proc: VmHWM (the peak) and, from smaps, its resident memory by where it
lies: the weights file it maps (llama.cpp: the GGUF; pdserve: the block cache), the shared libraries, and
anonymous memory (heap: K/V pool, activations, the Python and torch runtime). Writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path

from pdserve.bench.llama_cpp import find_llama_server, llama_server_argv
from pdserve.bench.servers import ManagedServer, free_port, pdserve_argv

READY_TIMEOUT_S = 600
OUT = Path(__file__).resolve().parent / "out" / "serve_memory.json"


def kv_bytes(gguf_path: Path, context: int) -> int:
    """f16 K and V for `context` tokens, as llama-server allocates them for this model."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = str(reader.fields["general.architecture"].contents())
    value = lambda key: int(reader.fields[f"{arch}.{key}"].contents())              # noqa: E731
    heads, kv_heads = value("attention.head_count"), value("attention.head_count_kv")
    head_dim = value("embedding_length") // heads
    return 2 * value("block_count") * kv_heads * head_dim * context * 2


def memory_of(pid: int, weights_suffix: str) -> dict[str, int]:
    """VmHWM and VmRSS, and the resident bytes (smaps) of the weights file, shared libraries, other files
    and anonymous memory of process `pid`."""
    status = Path(f"/proc/{pid}/status").read_text()
    peak = {key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) * 1024 for key in ("VmHWM", "VmRSS")}
    parts = {"weights file": 0, "shared libraries": 0, "other files": 0, "anonymous (heap, K/V, runtime)": 0}
    where = "anonymous (heap, K/V, runtime)"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            path = fields[5] if len(fields) > 5 else ""
            where = ("weights file" if path.endswith(weights_suffix) else "shared libraries" if ".so" in path
                     else "other files" if path.startswith("/") else "anonymous (heap, K/V, runtime)")
        elif fields and fields[0] == "Rss:":
            parts[where] += int(fields[1]) * 1024
    return {**peak, **parts}


def _complete(url: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def measure(argv: list[str], args, name: str, weights_suffix: str) -> dict:
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in argv]
    with ManagedServer(argv, OUT.parent / f"serve_memory-{name}.log", {}, grace=10) as server:
        url = f"http://127.0.0.1:{port}"
        server.wait_ready(url, READY_TIMEOUT_S)
        for i in range(args.requests):
            _complete(url, f"Request {i}: write a long story about the sea. " * 8, args.max_tokens)
        return {"server": name, "command": " ".join(argv), **memory_of(server.process.pid, weights_suffix)}


def pdserve_command(args, kv: int) -> list[str]:
    return [*pdserve_argv(str(args.model)), "--kv-cache-memory", str(kv), "--prefill-threads", "1",
            "--decode-threads", str(max(args.threads - 1, 1)), *args.pdserve_args]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the GGUF both servers load")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (default: on PATH)")
    p.add_argument("--context", type=int, default=4096, help="llama-server's -c; pdserve's pool holds as many")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pdserve-args", nargs=argparse.REMAINDER, default=[], help="more flags for pdserve serve")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    kv = kv_bytes(args.model, args.context)
    rows = []
    measure(pdserve_command(args, kv), args, "pdserve-warm-up", ".blocks")      # NOTE: builds the caches
    rows.append(measure(pdserve_command(args, kv), args, "pdserve", ".blocks"))
    binary = find_llama_server(args.llama_server)
    if binary:
        rows.append(measure(llama_server_argv(binary, args.model, args.threads, args.context, 1, "f16", "{port}"),
                            args, "llama.cpp", args.model.suffix))
    else:
        print("llama-server not found: pdserve only", file=sys.stderr)
    for row in rows:
        spread = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in row.items() if k not in ("server", "command", "VmHWM"))
        print(f"{row['server']:10s} peak RSS {row['VmHWM'] / 2**20:7.1f} MiB  (now, MiB: {spread})")
    if len(rows) == 2:
        print(f"pdserve - llama.cpp: {(rows[0]['VmHWM'] - rows[1]['VmHWM']) / 2**20:+.1f} MiB (target: at most +300)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kv_bytes": kv, "context": args.context, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
