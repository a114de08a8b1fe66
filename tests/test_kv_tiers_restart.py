"""The disk tier across a restart of a real `pdserve serve` process: SIGKILLed and started again on the same model,
the server answers a conversation whose prefix was written before the kill from the disk tier (counted on
/metrics) with the same tokens, and after a SIGTERM the prefixes still in the pool at the stop too; a tier file truncated or with flipped bytes in between gives the same tokens as no
tier, and /metrics counts the bad blocks."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import unused_port

from pdserve.engine.worker.tiers.disk import PAGE
from tests.test_engine_modes import prompts

REPO = Path(__file__).resolve().parent.parent
OPENINGS = [list(p) for p in prompts([96] * 6, seed=71)]
FILLERS = [list(p) for p in prompts([150] * 5, seed=72)]


class Server:
    """`pdserve serve` on the tiny model with a small pool and a disk tier in `folder`."""

    def __init__(self, model_dir: Path, folder: Path, log: Path) -> None:
        self.port = unused_port()
        self.base = f"http://127.0.0.1:{self.port}"
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
        command = [sys.executable, "-m", "pdserve.server.cli", "serve", "--model", str(model_dir),
                   "--port", str(self.port), "--served-model-name", "tiny", "--dtype", "float32", "--mode", "colocated",
                   "--kv-cache-memory", "640KiB", "--max-model-len", "240", "--kv-offload-disk", f"{folder}:4MiB",
                   "--ttft-slo-ms", "1000", "--itl-slo-ms", "100", "--no-startup-profile"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path}, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.log = log

    async def ready(self, session: aiohttp.ClientSession) -> None:
        for _ in range(1200):
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                async with session.get(f"{self.base}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"not ready; log:\n{self.log.read_text()[-3000:]}")

    async def complete(self, session: aiohttp.ClientSession, prompt: list[int]) -> tuple[list[str], int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        async with session.post(f"{self.base}/v1/completions", json=body) as response:
            data = await response.json()
        assert response.status == 200, data
        return data["choices"][0]["logprobs"]["tokens"], data["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def tier_metrics(self, session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(f"{self.base}/metrics") as response:
            text = await response.text()
        return {name: float(value) for name, value in
                re.findall(r'^pdserve_kv_tier_(\w+)\{tier="disk"\} (\S+)$', text, re.MULTILINE)}

    def stop(self) -> None:
        """SIGTERM, as systemd stops a unit; the server drains and exits."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=120) == 0, self.log.read_text()[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    started: list[Server] = []

    def start() -> Server:
        started.append(Server(tiny_model_dir, tmp_path / "tiers", tmp_path / "server.log"))
        return started[-1]

    yield start
    for server in started:
        server.kill()


def damage(folder: Path) -> None:
    """Flip a byte in every block of the tier file, then cut the file inside its blocks."""
    (path,) = folder.glob("kv-*.tier")
    meta = path.read_bytes()[:PAGE].decode()
    slots, block_bytes = (int(re.search(rf'"{k}": (\d+)', meta).group(1)) for k in ("slots", "block_bytes"))
    blocks = PAGE + -(-slots * 128 // PAGE) * PAGE
    stride = -(-block_bytes // PAGE) * PAGE
    with path.open("r+b") as f:
        for slot in range(slots // 2):
            f.seek(blocks + slot * stride + 77)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
    os.truncate(path, blocks + (slots // 2) * stride + 1000)


async def first_run(serve) -> list[list[str]]:
    """Each opening answered, then fillers that push them out of the pool into the disk tier; SIGKILL."""
    server = serve()
    async with aiohttp.ClientSession() as session:
        await server.ready(session)
        answers = [(await server.complete(session, p))[0] for p in OPENINGS]
        for filler in FILLERS:
            await server.complete(session, filler)
        held = await server.tier_metrics(session)
    server.kill()
    assert held["blocks"] >= len(OPENINGS) * 5, held
    return answers


async def again(serve, openings: list[int]) -> tuple[list[tuple[list[str], int]], dict[str, float]]:
    server = serve()
    async with aiohttp.ClientSession() as session:
        await server.ready(session)
        results = [await server.complete(session, OPENINGS[i]) for i in openings]
        metrics = await server.tier_metrics(session)
    server.kill()
    return results, metrics


def test_after_sigkill_a_known_prefix_is_answered_from_the_disk_tier(serve):
    async def run():
        before = await first_run(serve)
        results, metrics = await again(serve, [0, 3])
        return before, results, metrics

    before, results, metrics = asyncio.run(run())
    assert [tokens for tokens, _ in results] == [before[0], before[3]]
    assert all(cached >= 80 for _, cached in results)          # 5 of its 6 blocks came from disk
    assert metrics["hits_total"] >= 160 and metrics["bad_blocks_total"] == 0


def test_after_a_stop_the_pools_cached_prefixes_are_answered_from_the_disk_tier(serve):
    """Nothing left the pool before the stop (no fillers): the stop itself writes the cached blocks down."""
    async def run():
        server = serve()
        async with aiohttp.ClientSession() as session:
            await server.ready(session)
            before = [(await server.complete(session, OPENINGS[i]))[0] for i in (0, 1)]
            held = await server.tier_metrics(session)
        server.stop()
        results, metrics = await again(serve, [0, 1])
        return before, held, results, metrics

    before, held, results, metrics = asyncio.run(run())
    assert held["blocks"] == 0                                  # all still in the pool at the stop
    assert [tokens for tokens, _ in results] == before
    assert all(cached >= 80 for _, cached in results)
    assert metrics["hits_total"] >= 160 and metrics["bad_blocks_total"] == 0


def test_a_damaged_tier_file_gives_the_answers_of_no_tier_and_counts_its_bad_blocks(serve, tmp_path):
    async def run():
        before = await first_run(serve)
        damage(tmp_path / "tiers")
        results, metrics = await again(serve, range(len(OPENINGS)))
        return before, results, metrics

    before, results, metrics = asyncio.run(run())
    assert [tokens for tokens, _ in results] == before
    assert metrics["bad_blocks_total"] > 0
