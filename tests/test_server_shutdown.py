"""SIGTERM on a real `python -m pdserve.server.cli serve` process: running streams end cleanly, new requests
get 503, the process exits 0. Readiness and draining are observed through systemd's notify socket."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import unused_port

REPO = Path(__file__).resolve().parent.parent
LONG = 1000                                    # tokens: the stream is still running when SIGTERM lands


class ServerProcess:
    def __init__(self, model_dir: Path, tmp_path: Path, *options: str) -> None:
        self.port = unused_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp_path / "notify"))
        self.notify.setblocking(False)
        self.log = tmp_path / "pdserve.server.log"
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "400000",
               "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-m", "pdserve.server.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
                   "--max-model-len", str(LONG + 64), "--kv-cache-memory", "64MiB", *options]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    async def wait_for(self, message: bytes, seen: list[bytes] | None = None) -> None:
        """Read notify messages until one contains `message` (the server process must stay up)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.notify, 4096), 120)
            except asyncio.TimeoutError:
                raise AssertionError(f"no {message!r}; log:\n{self.log.read_text()}") from None
            if seen is not None:
                seen.append(data)
            if message in data.split(b"\n"):
                return

    def exit_code(self) -> int:
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.notify.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()


@pytest.fixture
def server_process(tiny_model_dir, tmp_path):
    started: list[ServerProcess] = []

    def start(*options: str) -> ServerProcess:
        started.append(ServerProcess(tiny_model_dir, tmp_path, *options))
        return started[-1]

    yield start
    for process in started:
        process.kill()


def stream_body(model: str) -> dict:
    return {"model": model, "prompt": "a long story", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def parse_stream(first: bytes, rest: bytes) -> tuple[str, int]:
    """(finish_reason, completion tokens) of a completions stream, checking its framing."""
    raw = first + rest
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]
    reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert all(r is None for r in reasons[:-1])
    return reasons[-1], events[-1]["usage"]["completion_tokens"]


async def test_sigterm_lets_running_streams_finish_and_exits_0(server_process, tiny_model_dir):
    server = server_process("--shutdown-timeout", "120")
    notes: list[bytes] = []
    await server.wait_for(b"READY=1", notes)
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base + "/v1/completions", json=stream_body(tiny_model_dir.name)) as stream:
            first = await stream.content.readuntil(b"\n\n")
            server.proc.send_signal(signal.SIGTERM)
            await server.wait_for(b"STOPPING=1", notes)
            async with session.post(server.base + "/v1/completions",
                                    json={"model": tiny_model_dir.name, "prompt": "late"}) as late:
                assert late.status == 503 and late.headers["Retry-After"] == "1"
            rest = await stream.read()
    assert parse_stream(first, rest) == ("length", LONG)
    assert server.exit_code() == 0, server.log.read_text()
    assert b"WATCHDOG=1" in notes
    log = server.log.read_text()
    assert "drained: every stream finished" in log
    assert f"output_tokens={LONG}" in log                       # the stream's access-log line


async def test_sigterm_after_the_shutdown_timeout_aborts_streams_and_exits_0(server_process, tiny_model_dir):
    server = server_process("--shutdown-timeout", "0", "--mode", "colocated")
    await server.wait_for(b"READY=1")
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base + "/v1/completions", json=stream_body(tiny_model_dir.name)) as stream:
            first = await stream.content.readuntil(b"\n\n")
            server.proc.send_signal(signal.SIGTERM)
            rest = await stream.read()
    reason, tokens = parse_stream(first, rest)
    assert (reason, tokens == LONG) in (("abort", False), ("length", True))
    assert server.exit_code() == 0, server.log.read_text()
