"""bench/multiturn.py, bench/turn_metrics.py and bench/server_metrics.py: seeded conversations, histories
that grow with the real answers, turns that wait for them, per-turn TTFT, and the prefix-cache hit
rate read from a server's /metrics; against an in-process chat server that logs what it saw."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, generate_latest

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.multiturn import benchmark_conversations, build_conversations, converse, warmup_requests
from pdserve.bench.server_metrics import HITS, QUERIES, parse_prefix_cache, prefix_cache_delta
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.turn_metrics import format_turns, markdown_turns, turn_summary
from pdserve.bench.workloads import TrafficSpec, WorkloadSpec

SPEC = WorkloadSpec(name="multiturn", seed=3, num_conversations=5, num_turns=4, system_prompt_len=40,
                    user_message_len=6, output_len=3)


def test_conversations_are_seeded_and_share_one_system_prompt():
    conversations = build_conversations(SPEC)
    assert conversations == build_conversations(SPEC)
    assert conversations != build_conversations(WorkloadSpec(**{**_fields(SPEC), "seed": 4}))
    assert len(conversations) == 5 and [c.index for c in conversations] == list(range(5))
    assert len({c.system_prompt for c in conversations}) == 1
    assert len(conversations[0].system_prompt.split()) == 40
    users = [m for c in conversations for m in c.user_messages]
    assert len(users) == 20 and len(set(users)) == 20 and all(len(m.split()) == 6 for m in users)
    warmup = warmup_requests(SPEC, 2)
    assert len(warmup) == 2 and warmup[0].messages[0]["content"] != conversations[0].system_prompt
    for bad in ({"num_turns": 0}, {"system_prompt_len": 0}, {"think_time": -1.0}):
        with pytest.raises(ValueError):
            build_conversations(WorkloadSpec(**{**_fields(SPEC), **bad}))


def test_a_document_goes_into_each_conversations_first_message_only():
    spec = WorkloadSpec(**{**_fields(SPEC), "document_len": 30})
    conversations = build_conversations(spec)
    firsts = [c.user_messages[0] for c in conversations]
    assert all(len(m.split()) == 36 for m in firsts) and len(set(firsts)) == 5     # its own document each
    assert all(len(m.split()) == 6 for c in conversations for m in c.user_messages[1:])
    with pytest.raises(ValueError):
        build_conversations(WorkloadSpec(**{**_fields(SPEC), "document_len": -1}))


def _fields(spec: WorkloadSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


async def test_each_turn_resends_the_history_with_the_previous_answers():
    conversation = build_conversations(SPEC)[2]
    sent = []

    async def send(sample, index):
        sent.append((index, sample))
        return RequestRecord(index, sample.kind, sample.prompt_len, sample.output_len, 0.0, success=True), \
            f"answer {index} to {sample.messages[-1]['content'][:8]}"

    records = await converse(SPEC, conversation, send)
    assert [r.index for r in records] == [index for index, _ in sent] == [8, 9, 10, 11]
    for turn, (index, sample) in enumerate(sent, start=1):
        assert (sample.conversation, sample.turn, sample.kind) == (2, turn, "chat")
        assert [m["role"] for m in sample.messages] == ["system"] + ["user", "assistant"] * (turn - 1) + ["user"]
        assert sample.messages[0]["content"] == conversation.system_prompt
        assert sample.messages[-1]["content"] == conversation.user_messages[turn - 1] == sample.prompt
        assert sample.prompt_len == 40 + turn * 6 + (turn - 1) * 3
        if turn > 1:
            previous = sent[turn - 2][1]
            answer = f"answer {previous.conversation * 4 + turn - 2} to {previous.prompt[:8]}"
            assert sample.messages[:-1] == (*previous.messages, {"role": "assistant", "content": answer})


class ChatServer:
    """Streams a unique answer per request and logs every request's start and end. First turns under
    `system` are held until `hold` of them are in flight (proof that conversations interleave); a request
    whose last user message is in `fail` gets a 500. Exports prefix-cache counters (words)."""

    def __init__(self, system: str, hold: int, fail: frozenset[str] = frozenset()) -> None:
        self.system, self.hold, self.fail = system, hold, fail
        self.log: list[tuple[str, str]] = []
        self.bodies: list[dict] = []
        self.first_turns = 0
        self.all_first_turns = asyncio.Event()
        self.registry = CollectorRegistry()
        self.queries = Counter("pdserve_prefix_cache_queries", "q", ["actor"], registry=self.registry)
        self.hits = Counter("pdserve_prefix_cache_hits", "h", ["actor"], registry=self.registry)
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_get("/metrics", self.metrics)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        key = body["messages"][-1]["content"]
        self.log.append(("start", key))
        turn = sum(m["role"] == "user" for m in body["messages"])
        if key in self.fail:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        words = sum(len(m["content"].split()) for m in body["messages"])
        self.queries.labels("prefill").inc(words)
        self.hits.labels("prefill").inc(words - len(key.split()))
        if turn == 1 and body["messages"][0]["content"] == self.system:
            await self._wait_for_every_first_turn()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        answer = f"answer-to {key}"
        for word in answer.split():
            await response.write(f"data: {json.dumps(_chunk(word + ' '))}\n\n".encode())
        usage = {"prompt_tokens": words, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": turn}}
        await response.write(f"data: {json.dumps(_chunk('', 'length'))}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.log.append(("end", key))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _wait_for_every_first_turn(self) -> None:
        self.first_turns += 1
        if self.first_turns == self.hold:
            self.all_first_turns.set()
        await self.all_first_turns.wait()


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


@pytest.fixture
async def chat_server():
    servers = []

    async def start(**kwargs) -> tuple[ChatServer, str]:
        state = ChatServer(**kwargs)
        server = TestServer(state.app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return state, str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


def _endpoint(base: str, timeout: float = 60.0) -> EndpointConfig:
    return EndpointConfig(base_url=base, model="m", endpoint="chat", request_timeout=timeout)


async def test_turns_wait_for_answers_and_conversations_interleave(chat_server):
    conversations = build_conversations(SPEC)
    state, base = await chat_server(system=conversations[0].system_prompt, hold=SPEC.num_conversations)
    result = await benchmark_conversations(_endpoint(base), SPEC, TrafficSpec(seed=1), warmup_requests(SPEC, 1),
                                           progress=False)
    assert len(result.records) == 20 and all(r.success for r in result.records), result.records[0].error
    assert len(state.bodies) == 21
    for conversation in conversations:
        keys = conversation.user_messages
        for earlier, later in zip(keys, keys[1:]):
            assert state.log.index(("end", earlier)) < state.log.index(("start", later))
    first_ends = min(state.log.index(("end", c.user_messages[0])) for c in conversations)
    assert all(state.log.index(("start", c.user_messages[0])) < first_ends for c in conversations)
    by_last = {body["messages"][-1]["content"]: body for body in state.bodies}
    for conversation in conversations:
        for turn in range(1, SPEC.num_turns):
            history = by_last[conversation.user_messages[turn]]["messages"]
            assert history[-2] == {"role": "assistant", "content": f"answer-to {conversation.user_messages[turn - 1]} "}
    records = {(r.conversation, r.turn): r for r in result.records}
    assert all(records[(c, t)].cached_tokens == t for c in range(5) for t in range(1, 5))
    prompt = [[records[(c, t)].prompt_tokens for t in range(1, 5)] for c in range(5)]
    assert all(a < b for row in prompt for a, b in zip(row, row[1:]))
    queries = sum(sum(row) for row in prompt)
    assert result.prefix_cache["queries"] == queries                    # the warm-up is not counted
    assert result.prefix_cache["hits"] == queries - 20 * SPEC.user_message_len
    assert result.prefix_cache["actors"]["prefill"]["hit_rate"] == result.prefix_cache["hit_rate"]


async def test_a_failed_turn_ends_its_conversation(chat_server):
    spec = WorkloadSpec(**{**_fields(SPEC), "num_conversations": 2})
    kept, failing = build_conversations(spec)
    state, base = await chat_server(system=kept.system_prompt, hold=2, fail=frozenset({failing.user_messages[1]}))
    result = await benchmark_conversations(_endpoint(base), spec, TrafficSpec(), progress=False)
    by_turn = {(r.conversation, r.turn): r for r in result.records}
    assert len(by_turn) == 8 and all(by_turn[(0, t)].success for t in range(1, 5))
    assert by_turn[(1, 1)].success and not by_turn[(1, 2)].success and "HTTP 500" in by_turn[(1, 2)].error
    assert [by_turn[(1, t)].error for t in (3, 4)] == ["not sent: turn 2 of its conversation failed"] * 2
    sent = [body["messages"][-1]["content"] for body in state.bodies]
    assert len(sent) == 6 and not set(failing.user_messages[2:]) & set(sent)


def _turn_record(index: int, conversation: int, turn: int, ttft: float, success: bool = True, cached: int = 0):
    return RequestRecord(index, "chat", 10, 4, 0.0, success=success, prompt_tokens=10 * turn, output_tokens=4,
                         ttft=ttft, latency=ttft + 0.1, usage_reported=success, cached_tokens=cached,
                         conversation=conversation, turn=turn)


def test_turn_summary_percentiles_and_shares():
    records = [_turn_record(0, 0, 1, 0.100), _turn_record(1, 0, 2, 0.010, cached=8),
               _turn_record(2, 1, 1, 0.300), _turn_record(3, 1, 2, 0.030, cached=12),
               _turn_record(4, 2, 1, 0.200), _turn_record(5, 2, 2, 0.0, success=False)]
    delta = prefix_cache_delta({(QUERIES, "decode"): 5.0, (HITS, "decode"): 1.0},
                               {(QUERIES, "decode"): 105.0, (HITS, "decode"): 41.0, (QUERIES, "prefill"): 100.0,
                                (HITS, "prefill"): 0.0})
    summary = turn_summary(records, delta)
    assert summary["turns"]["1"]["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["turns"]["1"]["p90_ttft_ms"] == pytest.approx(280.0)
    assert (summary["turns"]["2"]["completed"], summary["turns"]["2"]["failed"]) == (2, 1)
    assert summary["turns"]["2"]["median_ttft_ms"] == pytest.approx(20.0)
    assert summary["median_ttft_later_turns_ms"] == pytest.approx(20.0)
    assert summary["median_ttft_turn1_ms"] == pytest.approx(200.0)
    assert summary["cached_prompt_tokens"] == 20 and summary["cached_prompt_token_share"] == pytest.approx(20 / 70)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(40 / 200)
    assert delta["actors"]["decode"] == {"queries": 100.0, "hits": 40.0, "hit_rate": 0.4}
    assert delta["actors"]["prefill"]["hit_rate"] == 0.0
    text = format_turns(summary)
    assert "decode 40.0%, prefill 0.0%" in text and "200.00" in text and "20 (28.6%)" in text
    table = markdown_turns([("on", summary), ("off", turn_summary(records, None)), ("failed", None)])
    assert "| turn 2 median TTFT (ms) | 20.00 | 20.00 | - |" in table
    assert "| prefix cache hit rate per actor (server /metrics) | decode 40.0%, prefill 0.0% | n/a | - |" in table


def test_prefix_cache_counters_from_prometheus_text():
    registry = CollectorRegistry()
    queries = Counter("pdserve_prefix_cache_queries", "tokens looked up", ["actor"], registry=registry)
    hits = Counter("pdserve_prefix_cache_hits", "tokens found", ["actor"], registry=registry)
    queries.labels("prefill").inc(64)
    hits.labels("prefill").inc(48)
    queries.labels("decode").inc(16)
    text = generate_latest(registry).decode()
    counters = parse_prefix_cache(text)
    assert counters == {(QUERIES, "prefill"): 64.0, (HITS, "prefill"): 48.0, (QUERIES, "decode"): 16.0}
    assert prefix_cache_delta({}, counters)["actors"]["decode"] == {"queries": 16.0, "hits": 0.0, "hit_rate": 0.0}
    assert parse_prefix_cache("pdserve_requests_running 3\n") is None
    assert parse_prefix_cache("<html>not found</html>") is None
    assert prefix_cache_delta(None, parse_prefix_cache(text)) is None
    assert prefix_cache_delta({}, {(QUERIES, ""): 0.0})["hit_rate"] is None
