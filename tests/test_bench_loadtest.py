"""bench/loadtest.py and bench/workloads.py: the load-test client against a fake
OpenAI-compatible aiohttp server with controlled faults, the CLI end to end, the
seeded workloads, and (once the server exists) a real pdserve server."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.bench import compare, compare_report, loadtest, servers
from pdserve.bench.metrics import summarize
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.workloads import (
    WORDS,
    SampleRequest,
    TrafficSpec,
    WorkloadSpec,
    arrival_offsets,
    build_workload,
    load_sharegpt,
    tokens_per_word,
)

REPO = Path(__file__).resolve().parents[1]


class FakeOpenAI:
    """Streams `max_tokens` chunks "t0 ", "t1 ", ... in awkward network pieces; the path's
    first segment picks the behaviour."""

    def __init__(self, root_mode: str = "ok") -> None:
        self.root_mode = root_mode
        self.payloads: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.counter = itertools.count()
        self.never = asyncio.Event()
        app = web.Application()
        app.router.add_post("/{mode}/v1/completions", self.generate)
        app.router.add_post("/{mode}/v1/chat/completions", self.generate)
        app.router.add_get("/{mode}/v1/models", self.models)
        app.router.add_get("/health", self.models)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.app = app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        mode = request.match_info.get("mode", self.root_mode)
        if mode == "hf":  # transformers serve: 422 on vLLM's fields, no [DONE]
            if "ignore_eos" in payload or "generation_config" not in payload:
                return web.json_response({"detail": "Unexpected fields"}, status=422)
            mode = "nodone"
        if mode == "flaky":
            mode = ("fail500", "truncate", "ok")[next(self.counter) % 3]
        if mode == "dies":  # only ever run in a server subprocess: the third request kills it mid-stream
            mode = "exit" if next(self.counter) == 2 else "ok"
        if mode == "fail500":
            return web.json_response({"error": {"message": "engine exploded", "type": "server_error"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, payload, mode)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, payload: dict, mode: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chat = "messages" in payload
        count = payload["max_tokens"]
        events = [self._chunk(chat, f"t{i} ", None) for i in range(count)]
        if mode in ("truncate", "reset", "hang", "error", "exit"):
            events = events[: count // 2]
        pieces = self._pieces(events)
        for piece in pieces:
            await response.write(piece)
        if mode == "exit":
            os._exit(1)
        if mode == "hang":
            await self.never.wait()
        if mode == "reset":
            request.transport.abort()
            return response
        if mode == "error":
            await response.write(b'data: {"error": {"message": "decode actor died"}}\r\n\r\n')
        if mode in ("ok", "nodone", "error"):
            prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": count}
            await response.write(f"data: {self._chunk(chat, '', 'length')}\r\n\r\n".encode())
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        if mode in ("ok", "error"):
            await response.write(b"data: [DONE]\r\n\r\n")
        if mode == "truncate":
            await response.write(b'data: {"choices": [{"te')
        await response.write_eof()
        return response

    @staticmethod
    def _chunk(chat: bool, text: str, finish: str | None) -> str:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return json.dumps({"id": "x", "choices": [choice | {"finish_reason": finish}]})

    @staticmethod
    def _pieces(events: list[str]) -> list[bytes]:
        """Events with CRLF endings and keep-alives, cut mid-event and merged in pairs."""
        stream = b"".join(f": keep-alive\r\n\r\ndata: {e}\r\n\r\n".encode() for e in events)
        cuts = list(range(0, len(stream), 37)) + [len(stream)]
        return [stream[a:b] for a, b in zip(cuts, cuts[1:])]


def serve_fake(port: int, mode: str) -> None:
    """Run FakeOpenAI as a server process (for bench.compare); "mode" applies to /v1/... at the root."""
    web.run_app(FakeOpenAI(root_mode=mode).app, host="127.0.0.1", port=port, print=None)


@pytest.fixture
async def fake():
    server_state = FakeOpenAI()
    server = TestServer(server_state.app, host="127.0.0.1")
    await server.start_server()
    server_state.base = str(server.make_url("")).rstrip("/")
    yield server_state
    server_state.never.set()
    await server.close()


def _endpoint(fake: FakeOpenAI, mode: str, **overrides) -> EndpointConfig:
    return EndpointConfig(base_url=f"{fake.base}/{mode}", model="fake-model", **overrides)


def _samples(output_len: int = 6) -> list[SampleRequest]:
    rng = np.random.default_rng(1)
    return [SampleRequest(" ".join(rng.choice(WORDS, 5 + i)), 5 + i, output_len + i % 3, "short") for i in range(9)]


async def _bench(endpoint: EndpointConfig, samples: list[SampleRequest], **traffic) -> loadtest.BenchResult:
    spec = TrafficSpec(num_prompts=len(samples), **traffic)
    return await loadtest.benchmark(endpoint, samples, spec, progress=False)


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_successful_streams_record_usage_and_one_gap_per_chunk(fake, api):
    samples = _samples()
    result = await _bench(_endpoint(fake, "ok", endpoint=api), samples)
    assert len(result.records) == len(samples) and all(r.success for r in result.records)
    for record, sample in zip(result.records, samples):
        assert record.output_tokens == sample.output_len and record.usage_reported
        assert record.prompt_tokens == sample.prompt_len
        assert len(record.itl) == sample.output_len - 1
        assert record.finish_reason == "length" and 0 < record.ttft <= record.latency
    assert all(p["ignore_eos"] and p["min_tokens"] == p["max_tokens"] for p in fake.payloads)
    assert sorted(p["max_tokens"] for p in fake.payloads) == sorted(s.output_len for s in samples)


@pytest.mark.parametrize("mode, reason", [
    ("truncate", "stream ended without [DONE] (incomplete event at the end)"),
    ("nodone", "stream ended without [DONE]"),
    ("fail500", "HTTP 500: "),
    ("error", "error event: decode actor died"),
    ("reset", "Error"),
])
async def test_faulty_streams_are_failures_with_reasons(fake, mode, reason):
    result = await _bench(_endpoint(fake, mode), _samples())
    assert len(result.records) == 9
    assert not any(r.success for r in result.records)
    assert all(reason in r.error for r in result.records), {r.error for r in result.records}
    if mode == "fail500":
        assert "engine exploded" in result.records[0].error


async def test_no_done_accepted_when_not_required_but_truncation_never(fake):
    result = await _bench(_endpoint(fake, "nodone", require_done=False), _samples())
    assert all(r.success and r.output_tokens == s.output_len for r, s in zip(result.records, _samples()))
    result = await _bench(_endpoint(fake, "truncate", require_done=False), _samples())
    assert not any(r.success for r in result.records)


async def test_mixed_faults_counts_and_concurrency_cap(fake):
    samples = _samples()
    result = await _bench(_endpoint(fake, "flaky"), samples, max_concurrency=2)
    summary = summarize(result.records, result.duration)
    assert (summary["completed"], summary["failed"]) == (3, 6)
    assert sum(summary["errors"].values()) == 6 and len(summary["errors"]) == 2
    ok = [r for r in result.records if r.success]
    assert summary["total_output_tokens"] == sum(r.max_tokens for r in ok) == sum(r.output_tokens for r in ok)
    assert 1 <= fake.max_in_flight <= 2


async def test_duration_bounds_the_sending(fake):
    rate, duration = 40.0, 0.25
    due = sum(1 for offset in itertools.islice(arrival_offsets(rate, 1.0, 0), 1000) if offset < duration)
    samples = itertools.cycle(_samples())
    spec = TrafficSpec(request_rate=rate, num_prompts=1000, duration=duration)
    result = await loadtest.benchmark(_endpoint(fake, "ok"), samples, spec, progress=False)
    assert 0 < len(result.records) <= due < 1000
    assert all(r.success for r in result.records)


async def test_stalled_server_times_out_instead_of_hanging(fake):
    result = await _bench(_endpoint(fake, "hang", request_timeout=0.5), _samples()[:3])
    assert [r.error for r in result.records] == ["timeout after 0.5 s"] * 3


async def test_dead_server_gives_connection_errors():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await _bench(EndpointConfig(f"http://127.0.0.1:{port}", "m"), _samples()[:3])
    assert all(not r.success and "Connect" in r.error for r in result.records)


async def test_overall_bound_cancels_what_is_still_running():
    never = asyncio.Event()
    sample = SampleRequest("x", 1, 4, "long")
    tasks = {asyncio.create_task(never.wait()): (i, sample, 0.5 * i) for i in range(3)}
    records = await loadtest._collect(tasks, bound=0.0)
    assert [r.index for r in sorted(records, key=lambda r: r.index)] == [0, 1, 2]
    assert all(not r.success and r.error.startswith("cancelled") for r in records)
    assert all(task.cancelled() for task in tasks)


async def test_resolve_model_lists_first_model(fake):
    assert await loadtest.resolve_model(f"{fake.base}/ok/v1") == "fake-model"
    with pytest.raises(loadtest.BenchError):
        await loadtest.resolve_model(f"{fake.base}/nothing-here/x")


async def test_cli_end_to_end_writes_json_and_plot(fake, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["--base-url", f"{fake.base}/ok", "--endpoint", "chat", "--dataset-name", "mixed",
            "--num-prompts", "10", "--short-input-len", "8", "--long-input-len", "64", "--output-len", "5",
            "--long-fraction", "0.2", "--request-rate", "200", "--seed", "3", "--num-warmups", "2",
            "--slo", "ttft_ms=60000", "tpot_ms=60000", "--result-json", str(out), "--plot", str(png),
            "--disable-tqdm"]
    assert await asyncio.to_thread(loadtest.main, argv) == 0
    document = json.loads(out.read_text())
    summary = document["summary"]
    assert (summary["completed"], summary["failed"], summary["completed_long"]) == (10, 0, 2)
    assert summary["total_output_tokens"] == 50 and summary["request_goodput"] > 0
    assert document["model"] == "fake-model"  # from GET /v1/models
    assert document["arguments"]["dataset_name"] == "mixed" and document["traffic"]["request_rate"] == 200.0
    assert document["arguments"]["request_timeout"] == 300.0
    assert document["arguments"]["slo"] == ["ttft_ms=60000", "tpot_ms=60000"]
    assert [r["kind"] for r in document["requests"]].count("long") == 2
    assert all(len(r["itl"]) == 4 and r["output_tokens"] == 5 for r in document["requests"])
    assert len(fake.payloads) == 12  # 2 warm-ups + 10 measured
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_plot_without_matplotlib_fails_before_any_request(fake, tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    argv = ["--base-url", f"{fake.base}/ok", "--num-prompts", "3", "--plot", str(tmp_path / "r.png"), "--disable-tqdm"]
    assert await asyncio.to_thread(loadtest.main, argv) == 2
    assert fake.payloads == [] and not (tmp_path / "r.png").exists()
    assert "pip install 'pdserve[bench]'" in capsys.readouterr().err


async def test_cli_exit_codes(fake, tmp_path):
    bad_slo = ["--base-url", f"{fake.base}/ok", "--slo", "p50_ms=5"]
    assert await asyncio.to_thread(loadtest.main, bad_slo) == 2
    missing = ["--dataset-path", str(tmp_path / "missing.json")]
    assert await asyncio.to_thread(loadtest.main, missing) == 2
    assert await asyncio.to_thread(loadtest.main, ["--tokenizer", str(tmp_path)]) == 2
    failing = ["--base-url", f"{fake.base}/fail500", "--model", "m", "--num-prompts", "2", "--disable-tqdm"]
    assert await asyncio.to_thread(loadtest.main, failing) == 1
    unreachable = ["--base-url", f"{fake.base}/x/y", "--num-prompts", "1"]
    assert await asyncio.to_thread(loadtest.main, unreachable) == 1


def test_workloads_are_deterministic_per_seed():
    for name in ("random", "mixed"):
        spec = WorkloadSpec(name=name, seed=5, random_range_ratio=0.5, random_input_len=40, long_input_len=300)
        first = list(itertools.islice(build_workload(spec), 20))
        assert first == list(itertools.islice(build_workload(spec), 20))
        other = list(itertools.islice(build_workload(WorkloadSpec(name=name, seed=6)), 20))
        assert [s.prompt for s in first] != [s.prompt for s in other]


def test_random_workload_lengths_within_range():
    spec = WorkloadSpec(name="random", random_input_len=100, random_output_len=20, random_range_ratio=0.25,
                        long_threshold=120)
    samples = list(itertools.islice(build_workload(spec), 500))
    assert {s.prompt_len for s in samples} <= set(range(75, 126))
    assert {s.output_len for s in samples} <= set(range(15, 26))
    assert min(s.prompt_len for s in samples) == 75 and max(s.prompt_len for s in samples) == 125
    assert all(len(s.prompt.split()) == s.prompt_len for s in samples)
    assert all(s.kind == ("long" if s.prompt_len >= 120 else "short") for s in samples)
    with pytest.raises(ValueError):
        build_workload(WorkloadSpec(name="random", random_range_ratio=1.0))


def test_prompts_sized_in_a_real_tokenizers_tokens():
    from tokenizers import Tokenizer

    from pdserve.engine.model.demo import default_model_dir

    model_dir = default_model_dir("tiny")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ratio = tokens_per_word(model_dir)
    assert ratio == tokens_per_word(model_dir / "tokenizer.json") and ratio > 1.5  # the demo BPE splits words
    spec = WorkloadSpec(name="mixed", seed=9, short_input_len=256, long_input_len=2048, long_fraction=0.5,
                        tokens_per_word=ratio)
    for sample in itertools.islice(build_workload(spec), 6):
        measured = len(tokenizer.encode(sample.prompt, add_special_tokens=False).ids)
        assert measured == pytest.approx(sample.prompt_len, rel=0.1)
    with pytest.raises(FileNotFoundError):
        tokens_per_word(model_dir / "missing")


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 1 / 3, 1.0])
def test_mixed_workload_long_share_is_exact(fraction):
    spec = WorkloadSpec(name="mixed", long_fraction=fraction, short_input_len=7, long_input_len=50, output_len=3)
    samples = list(itertools.islice(build_workload(spec), 60))
    longs = [s for s in samples if s.kind == "long"]
    assert len(longs) == round(60 * fraction)
    assert all(s.prompt_len == 50 and len(s.prompt.split()) == 50 for s in longs)
    assert all(s.prompt_len == 7 and s.output_len == 3 for s in samples if s.kind == "short")


def test_sharegpt_file_filtering_and_cycling(tmp_path):
    long_text = "word " * 2000
    conversations = [
        {"conversations": [{"from": "human", "value": "Tell me about the sea, please."},
                           {"from": "gpt", "value": "The sea is large and full of water and fish."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there, friend"}]},
        {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": "ok ok ok ok ok"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    assert load_sharegpt(path, None) == [("Tell me about the sea, please.", 8, 11)]
    samples = list(itertools.islice(build_workload(WorkloadSpec(name="sharegpt", dataset_path=str(path))), 3))
    assert [s.output_len for s in samples] == [11, 11, 11]
    fixed = next(build_workload(WorkloadSpec(name="sharegpt", dataset_path=str(path), sharegpt_output_len=2)))
    assert fixed.output_len == 2
    path.write_text(json.dumps(conversations[1:]))
    with pytest.raises(ValueError):
        load_sharegpt(path, None)


def test_arrival_gaps_have_the_gamma_mean_and_variance():
    rate, burstiness = 4.0, 0.5
    offsets = np.array(list(itertools.islice(arrival_offsets(rate, burstiness, seed=1), 40001)))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.06)
    assert list(itertools.islice(arrival_offsets(math.inf, 1.0, 0), 5)) == [0.0] * 5
    again = list(itertools.islice(arrival_offsets(rate, burstiness, seed=1), 10))
    assert again == offsets[:10].tolist()


def _fake_spec(name: str, title: str, mode: str, **overrides) -> servers.ServerSpec:
    code = f"import sys; from tests.test_bench_loadtest import serve_fake; serve_fake(int(sys.argv[1]), {mode!r})"
    return servers.ServerSpec(name, title, (sys.executable, "-c", code, "{port}"), **overrides)


def _compare_args(tmp_path: Path) -> argparse.Namespace:
    return compare.parse_args([
        "--num-prompts", "6", "--short-input-len", "8", "--long-input-len", "40", "--output-len", "4",
        "--long-fraction", "0.34", "--request-rate", "inf", "--num-warmups", "1", "--disable-tqdm",
        "--result-json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"),
        "--log-dir", str(tmp_path / "logs"), "--report", str(tmp_path / "report.md"), "--server-timeout", "60"])


def test_compare_runs_each_server_and_writes_its_report(tmp_path, capsys):
    args = _compare_args(tmp_path)
    options = loadtest.options_from_args(args)
    md = tmp_path / "report.md"
    md.write_text("# an earlier run\n")
    hf = dict(length_control="generation-config", require_done=False)
    specs = [_fake_spec("pdserve-disaggregated", "pdserve disaggregated", "ok"),
             _fake_spec("pdserve-colocated", "pdserve colocated", "ok"),
             _fake_spec("transformers", "transformers serve", "hf", **hf)]
    assert compare.run_comparison(specs, args, options, "MODEL", "python -m pdserve.bench.compare --first") == 0
    document = json.loads((tmp_path / "c.json").read_text())
    for server in document["servers"]:
        assert server["ok"] and server["summary"]["completed"] == 6 and server["summary"]["completed_long"] == 2
        assert server["summary"]["total_output_tokens"] == 24 and len(server["requests"]) == 6
        assert server["role_timeline"] == []                                  # the fake has no /metrics
    assert set(document["targets"]) == {t.what for t in compare_report.TARGETS[:4]}  # the three servers, no issue-13 load
    assert document["traffic"]["request_rate"] == "inf" and document["model"] == "MODEL"
    assert all(" vs " in verdict and verdict.endswith("met") for verdict in document["targets"].values())
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    first = md.read_text()
    assert first.startswith("# Serving comparison (default): pdserve disaggregated vs")  # replaced, not appended
    assert "| status | ok | ok | ok |" in first and "--first" in first and "an earlier run" not in first
    assert f"pdserve.bench.compare: report {md}; per-request data {tmp_path / 'c.json'}; plot {tmp_path / 'c.png'}" \
        in capsys.readouterr().out

    broken = servers.ServerSpec("transformers", "transformers serve",
                                (sys.executable, "-c", "import sys; print('no fastapi here'); sys.exit(3)"), **hf)
    specs = [_fake_spec("pdserve-disaggregated", "pdserve disaggregated", "ok"), broken]
    assert compare.run_comparison(specs, args, options, "MODEL", "python -m pdserve.bench.compare --second") == 1
    document = json.loads((tmp_path / "c.json").read_text())
    error = document["servers"][1]["error"]
    assert "exited with code 3" in error and "no fastapi here" in error
    assert document["targets"]["output tok/s >= 2 x transformers serve"] == "n/a (transformers serve failed)"
    second = md.read_text()
    assert "--second" in second and "--first" not in second and "| status | ok | **failed** |" in second


def test_compare_writes_under_bench_out_and_never_the_results_page(tmp_path):
    out = compare.REPO / "bench" / "out"
    plain = compare.parse_args([])
    assert (plain.report, plain.result_json, plain.plot, plain.log_dir) == (
        str(out / "compare.md"), str(out / "compare.json"), str(out / "compare.png"), str(out / "logs"))
    named = compare.parse_args(["--section", "30% long", "--report", str(tmp_path / "r.md")])
    assert (named.result_json, named.plot) == (str(tmp_path / "r.json"), str(tmp_path / "r.png"))
    assert compare.parse_args(["--section", "30% long"]).report == str(out / "compare_30_long.md")
    page = compare.REPO / "bench" / "RESULTS.md"
    before = page.read_bytes()
    assert compare.run(compare.parse_args(["--report", str(page)]), ["--report", str(page)]) == 2
    assert page.read_bytes() == before


STUBBORN_SERVER = """
import http.server, json, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "stubborn"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


async def test_server_dying_mid_run_gives_errors_not_a_hang(tmp_path):
    port = servers.free_port()
    code = f"import sys; from tests.test_bench_loadtest import serve_fake; serve_fake({port}, 'dies')"
    with servers.ManagedServer([sys.executable, "-c", code], tmp_path / "s.log", {}, grace=5) as server:
        await asyncio.to_thread(server.wait_ready, f"http://127.0.0.1:{port}", 60)
        endpoint = EndpointConfig(f"http://127.0.0.1:{port}", "fake-model")
        result = await _bench(endpoint, _samples()[:6], max_concurrency=1)
    assert [r.success for r in result.records] == [True, True, False, False, False, False]
    died_mid_stream, after_death = result.records[2], result.records[3:]
    assert died_mid_stream.output_tokens > 0 and died_mid_stream.error
    # what the client reads after the death races the process's teardown (refused, reset, or disconnected)
    assert all(r.output_tokens == 0 and r.error for r in after_death), [r.error for r in after_death]
    assert server.process.returncode == 1


def test_managed_server_escalates_to_sigkill(tmp_path):
    port = servers.free_port()
    argv = [sys.executable, "-c", STUBBORN_SERVER, str(port)]
    with servers.ManagedServer(argv, tmp_path / "s.log", {}, grace=0.5) as server:
        assert server.wait_ready(f"http://127.0.0.1:{port}", timeout=60) == "stubborn"
    assert server.process.returncode == -9


def test_managed_server_readiness_failures_and_sigterm(tmp_path):
    exits = [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"]
    with servers.ManagedServer(exits, tmp_path / "a.log", {}, grace=5) as server:
        with pytest.raises(RuntimeError, match="exited with code 3 before it was ready: bad flag --x"):
            server.wait_ready(f"http://127.0.0.1:{servers.free_port()}", timeout=60)
    silent = [sys.executable, "-c", "import time; print('loading'); time.sleep(600)"]
    with servers.ManagedServer(silent, tmp_path / "b.log", {}, grace=30) as server:
        with pytest.raises(RuntimeError, match="not ready after 1 s"):
            server.wait_ready(f"http://127.0.0.1:{servers.free_port()}", timeout=1.0)
    assert server.process.returncode == -15


def test_server_specs_commands():
    specs = servers.server_specs("/m", ["pdserve-colocated", "pdserve-disaggregated"], ["--dtype", "float32"], [])
    shown = [servers.display_command([part.replace("{port}", "9") for part in spec.argv]) for spec in specs]
    common = "--prefill-device cpu --decode-device cpu --dtype float32"
    assert shown == [f"pdserve serve --model /m --port 9 --mode colocated {common}",
                     f"pdserve serve --model /m --port 9 --mode disaggregated {common}"]
    (hf,) = servers.server_specs("/m", ["transformers"], [], ["--dtype", "bfloat16"])
    assert servers.display_command([p.replace("{port}", "9") for p in hf.argv]) == (
        "transformers serve /m --continuous-batching --device cpu --host 127.0.0.1 --port 9 --dtype bfloat16")
    assert (hf.length_control, hf.require_done, hf.env["HF_HUB_OFFLINE"]) == ("generation-config", False, "1")


@pytest.fixture(scope="module")
def pdserve_tiny(tmp_path_factory):
    """Base URL of a real `pdserve` serving the tiny demo model (`--model demo:tiny`) on a free port."""
    port = servers.free_port()
    serve = [sys.executable, "-m", "pdserve.server.cli", "serve", "--model", "demo:tiny", "--port", str(port)]
    log = tmp_path_factory.mktemp("pdserve-tiny") / "pdserve.server.log"
    with servers.ManagedServer(serve, log, {}, grace=30) as server:
        server.wait_ready(f"http://127.0.0.1:{port}", timeout=240)
        yield f"http://127.0.0.1:{port}"


def test_pdserve_bench_against_real_server(tmp_path, pdserve_tiny):
    out = tmp_path / "pdserve.bench.json"
    bench = subprocess.run(
        [sys.executable, "-m", "pdserve.server.cli", "bench", "--base-url", pdserve_tiny,
         "--dataset-name", "mixed", "--num-prompts", "6", "--short-input-len", "8", "--long-input-len", "64",
         "--output-len", "4", "--long-fraction", "0.34", "--request-rate", "inf", "--temperature", "0",
         "--result-json", str(out), "--disable-tqdm"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    assert "Serving Benchmark Result" in bench.stdout
    document = json.loads(out.read_text())
    summary = document["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == 6 * 4 and summary["requests_without_usage"] == 0
    assert [r["kind"] for r in document["requests"]].count("long") == 2
    for record in document["requests"]:
        assert record["output_tokens"] == 4 and record["prompt_tokens"] > 0 and len(record["itl"]) <= 3
    long_tokens = [r["prompt_tokens"] for r in document["requests"] if r["kind"] == "long"]
    assert min(long_tokens) > max(r["prompt_tokens"] for r in document["requests"] if r["kind"] == "short")


def test_multiturn_bench_against_real_server(tmp_path, pdserve_tiny, capsys):
    out = tmp_path / "multiturn.json"
    argv = ["--base-url", pdserve_tiny, "--dataset-name", "multiturn", "--num-conversations", "3", "--num-turns", "3",
            "--system-prompt-len", "40", "--user-message-len", "6", "--output-len", "4", "--request-rate", "inf",
            "--temperature", "0", "--seed", "5", "--result-json", str(out), "--disable-tqdm"]
    assert loadtest.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Multi-turn chat and prefix cache" in printed and "Prefix cache hit rate (server):" in printed
    document = json.loads(out.read_text())
    summary = document["summary"]
    assert (summary["completed"], summary["failed"]) == (9, 0) and document["endpoint"] == "chat"
    assert sorted(summary["turns"]) == ["1", "2", "3"] and summary["median_ttft_later_turns_ms"] > 0
    turns = {(r["conversation"], r["turn"]): r for r in document["requests"]}
    for conversation in range(3):
        sizes = [turns[(conversation, turn)]["prompt_tokens"] for turn in (1, 2, 3)]
        assert sizes[0] < sizes[1] < sizes[2]                         # each turn resends the grown history
        assert all(r["output_tokens"] == 4 for r in (turns[(conversation, t)] for t in (1, 2, 3)))
    assert all(0 <= r["cached_tokens"] < r["prompt_tokens"] for r in document["requests"])
    rate = summary["prefix_cache_hit_rate"]
    assert rate is None or 0.0 <= rate <= 1.0           # None: an engine without prefix-cache counters
