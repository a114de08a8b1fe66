"""llama.cpp's `llama-server` as the CPU reference: start it on a GGUF, time completions over its
OpenAI-compatible HTTP API with the same token-id prompts pdserve gets.

Requests are non-streaming `/v1/completions` with `ignore_eos` and `cache_prompt: false` (every pass
evaluates its prompt, as pdserve's does), sent all at once, one thread per request. How to build the
binary: bench/RESULTS.md, "CPU decode vs llama.cpp".
"""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

READY_TIMEOUT_S = 120


def find_llama_server(explicit: str | None) -> str | None:
    """The binary named by --llama-server, else `llama-server` on PATH, else None."""
    if explicit:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"--llama-server {explicit}: no such file")
        return explicit
    return shutil.which("llama-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_argv(binary: str, gguf: Path | str, threads: int, context: int, slots: int, kv_type: str,
                      port: str, extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server on 127.0.0.1:port: `threads` for prompts and generation, `slots` parallel sequences
    sharing one `context`-token KV cache (-kvu), K and V stored as `kv_type`; `extra` flags after those."""
    return [binary, "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context),
            "-np", str(slots), "-kvu", "-ctk", kv_type, "-ctv", kv_type, "--host", "127.0.0.1", "--port", port,
            *extra]


@contextlib.contextmanager
def llama_server(binary: str, gguf: Path, threads: int, context: int, slots: int,
                 kv_type: str = "f32", extra: tuple[str, ...] = (), memory: dict | None = None) -> Iterator[str]:
    """A running llama-server on 127.0.0.1; yields its base URL; stops it on exit, first recording its peak
    resident bytes (VmHWM) in `memory["peak_rss_bytes"]` when given a dict."""
    port = _free_port()
    command = llama_server_argv(binary, gguf, threads, context, slots, kv_type, str(port), extra)
    log = tempfile.TemporaryFile("w+")      # NOTE: a pipe nobody drains fills up and stalls the server
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
        yield url
        if memory is not None:
            memory["peak_rss_bytes"] = peak_rss_bytes(process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def peak_rss_bytes(pid: int) -> int:
    """A running process's peak resident memory (VmHWM in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_ready(url: str, process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited {process.returncode}: {log.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)               # NOTE: polling a child process's readiness, not synchronising our code
    raise TimeoutError(f"llama-server not ready after {READY_TIMEOUT_S} s")


def _complete(url: str, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos,
            "cache_prompt": False}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def timed_completions(url: str, prompts: list[list[int]], max_tokens: int,
                      ignore_eos: bool = True) -> tuple[float, list[dict]]:
    """Wall seconds for all prompts sent at once, and the responses (each has llama.cpp's `timings`)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        responses = list(pool.map(lambda p: _complete(url, p, max_tokens, ignore_eos), prompts))
        return time.perf_counter() - start, responses
