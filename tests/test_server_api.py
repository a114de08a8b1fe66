"""The OpenAI-compatible API end to end: a real server on a free port, the tiny demo model,
the official `openai` client (and raw bytes where the framing itself is under test)."""
from __future__ import annotations

import asyncio
import random

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.server.app import create_app
from pdserve.server.config import ServerConfig

MAX_MODEL_LEN = 256
USER = [{"role": "user", "content": "Say something about disaggregated inference."}]


def engine_config(model_dir, mode: str, max_queue: int = 512) -> EngineConfig:
    return EngineConfig(model=str(model_dir), mode=mode, cache=CacheConfig(kv_cache_memory="64MiB"),
                        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_queue=max_queue))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    built: dict[str, Engine] = {}

    def get(mode: str) -> Engine:
        if mode not in built:
            built[mode] = Engine(engine_config(tiny_model_dir, mode))
        return built[mode]

    yield get
    for engine in built.values():
        engine.close()


@pytest.fixture
async def serve():
    """`await serve(engine, **server_config)` -> base URL of a running server (its app: `serve.apps[url]`)."""
    servers: list[TestServer] = []

    async def start(engine: Engine, **overrides) -> str:
        server = TestServer(create_app(ServerConfig(engine=engine.config, **overrides), engine))
        await server.start_server()
        servers.append(server)
        base = str(server.make_url("")).rstrip("/")
        start.apps[base] = server.app
        return base

    async def close_all() -> None:
        for server in servers:
            await server.close()

    start.apps, start.close_all = {}, close_all
    yield start
    await close_all()


def client(base: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0)


async def scrape(base: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def wait_until_idle(base: str, tries: int = 400) -> dict:
    """Poll /metrics until no request runs, waits or holds a KV block."""
    for _ in range(tries):
        samples = await scrape(base)
        busy = [k for k, v in samples.items() if v and k[0] in (
            "pdserve_kv_blocks_used", "pdserve_requests_running", "pdserve_requests_waiting",
            "pdserve_requests_unfinished")]
        if not busy:
            return samples
        await asyncio.sleep(0.02)
    raise AssertionError(f"still busy after {tries} polls: {busy}")


def finished(samples: dict, reason: str) -> float:
    return samples[("pdserve_requests_finished_total", (("finish_reason", reason),))]


# streaming and non-streaming through the official client

@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_chat_stream_matches_non_stream_and_completions(engines, serve, tiny_model_dir, mode):
    engine = engines(mode)
    base = await serve(engine)
    async with client(base) as c:
        stream = await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        whole = await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=12,
                                                temperature=0)
        prompt_ids = engine.tokenizer.encode_chat(USER)
        as_text = await c.completions.create(model=tiny_model_dir.name, prompt=prompt_ids, max_tokens=12,
                                             temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens == len(prompt_ids)
    content = [ch for ch in chunks[1:-1]]
    assert all(ch.usage is None for ch in content)
    assert [ch.choices[0].finish_reason for ch in content][-1] in ("stop", "length")
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    streamed = "".join(ch.choices[0].delta.content or "" for ch in content)
    assert streamed == whole.choices[0].message.content == as_text.choices[0].text
    assert whole.usage.prompt_tokens == as_text.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == usage_chunk.usage.completion_tokens == as_text.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.choices[0].message.role == "assistant" and whole.model == tiny_model_dir.name


async def test_every_token_gets_a_chunk_even_one_that_completes_no_character(engines, serve, tiny_model_dir):
    """A byte token that ends mid-character still streams a chunk (empty content), as vLLM's does: a client
    timing tokens sees each step, not two at once. The demo model samples such tokens at temperature 1."""
    engine = engines("colocated")
    base = await serve(engine)
    async with client(base) as c:
        for seed in range(1, 8):
            stream = await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=40,
                                                     temperature=1.0, seed=seed, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            token_chunks, usage = chunks[1:-1], chunks[-1].usage
            if any(ch.choices[0].delta.content == "" for ch in token_chunks):
                break
        else:
            pytest.fail("no seed sampled a token that completes no character")
        whole = await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=40,
                                                temperature=1.0, seed=seed)
    assert len(token_chunks) == usage.completion_tokens
    assert "".join(ch.choices[0].delta.content or "" for ch in token_chunks) == whole.choices[0].message.content


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_completion_stream_several_prompts_and_n(engines, serve, tiny_model_dir, mode):
    engine = engines(mode)
    base = await serve(engine)
    prompts = ["The prefill actor", "KV blocks move between devices while"]
    async with client(base) as c:
        stream = await c.completions.create(model=tiny_model_dir.name, prompt=prompts, n=2, max_tokens=6,
                                            seed=7, logprobs=0, stream=True,
                                            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    tokens = {i: 0 for i in range(4)}
    endings = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        tokens[choice.index] += len(choice.logprobs.tokens)
        if choice.finish_reason:
            endings[choice.index] = choice.finish_reason
    assert sorted(endings) == [0, 1, 2, 3] and set(endings.values()) <= {"stop", "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert usage.completion_tokens == sum(tokens.values())
    assert all(1 <= n <= 6 for n in tokens.values())


async def test_seeded_choices_repeat_and_max_tokens_defaults_to_the_context_left(engines, serve, tiny_model_dir):
    engine = engines("disaggregated")
    base = await serve(engine)
    prompt = "a seeded prompt"
    async with client(base) as c:
        first = await c.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=8, seed=1234, n=2,
                                           extra_body={"ignore_eos": True})
        again = await c.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=8, seed=1234,
                                           extra_body={"ignore_eos": True})
        rest = await c.completions.create(model=tiny_model_dir.name, prompt=prompt, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].text == again.choices[0].text           # choice i samples with seed + i
    assert first.choices[1].text != first.choices[0].text
    prompt_len = len(engine.tokenizer.encode(prompt))
    assert rest.choices[0].finish_reason == "length"
    assert rest.usage.completion_tokens == MAX_MODEL_LEN - prompt_len


async def test_stop_string_echo_and_logprobs(engines, serve, tiny_model_dir):
    engine = engines("disaggregated")
    base = await serve(engine)
    prompt = "Tokens stream over server-sent events"
    async with client(base) as c:
        greedy = await c.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=16,
                                            temperature=0, logprobs=3, extra_body={"ignore_eos": True})
        text = greedy.choices[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        stopped = await c.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=16,
                                             temperature=0, stop=[stop], echo=True,
                                             extra_body={"ignore_eos": True})
        chat = await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=5,
                                               temperature=0, logprobs=True, top_logprobs=2)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == prompt + text[:text.index(stop)]
    lp = greedy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == greedy.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(logprob)    # greedy picks the best
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token


async def test_raw_sse_framing(engines, serve, tiny_model_dir):
    base = await serve(engines("disaggregated"))
    body = {"model": tiny_model_dir.name, "messages": USER, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "n": 2}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            raw = await response.read()
            headers = response.headers
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-1])
    chunks = [orjson.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert {c["choices"][0]["index"] for c in chunks[:2]} == {0, 1}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    last_of = {}
    for chunk in chunks[:-1]:
        last_of[chunk["choices"][0]["index"]] = chunk["choices"][0]
    assert all(last_of[i]["finish_reason"] in ("stop", "length") for i in (0, 1))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


async def test_models_and_health(engines, serve, tiny_model_dir):
    base = await serve(engines("colocated"), served_model_names=("tiny-test",))
    async with client(base) as c:
        models = await c.models.list()
        reply = await c.completions.create(model="tiny-test", prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError) as e:
            await c.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=2)
    assert [m.id for m in models.data] == ["tiny-test"] and reply.model == "tiny-test"
    assert e.value.code == "model_not_found"
    async with aiohttp.ClientSession() as session, session.get(base + "/health") as response:
        body = await response.json()
        assert response.status == 200 and body["mode"] == "colocated"
        assert body["status"] == "ok"
        assert body["units"] == [{"unit": "colocated", "role": "colocated", "up": True, "state": "up"}]


async def test_every_served_model_name_is_accepted_and_the_first_reported(engines, serve, tiny_model_dir):
    base = await serve(engines("colocated"), served_model_names=("first", "alias"))
    async with client(base) as c:
        replies = [await c.completions.create(model=name, prompt="x", max_tokens=2) for name in ("first", "alias")]
        models = await c.models.list()
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=2)
    assert [r.model for r in replies] == ["first", "first"] and [m.id for m in models.data] == ["first"]


# disconnects and metrics

@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_disconnect_mid_stream_aborts_and_frees_blocks(engines, serve, tiny_model_dir, mode):
    base = await serve(engines(mode))
    body = {"model": tiny_model_dir.name, "prompt": "a long story", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(base + "/v1/completions", json=body)
        assert response.status == 200
        await response.content.readuntil(b"\n\n")
        response.close()                                  # drop the connection mid-stream
    samples = await wait_until_idle(base)
    assert finished(samples, "abort") == 1 and finished(samples, "length") == 0
    used = [k for k in samples if k[0] == "pdserve_kv_blocks_used"]
    expected = {"colocated"} if mode == "colocated" else {"prefill", "decode"}
    assert {dict(labels)["actor"] for _, labels in used} == expected


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_many_concurrent_requests_with_random_disconnects(engines, serve, tiny_model_dir, mode):
    base = await serve(engines(mode))
    rng = random.Random(1234 + len(mode))
    plans = [(rng.random() < 0.5, rng.randint(0, 4), rng.randint(2, 12)) for _ in range(200)]

    async def one(session: aiohttp.ClientSession, i: int, disconnect: bool, after: int, max_tokens: int) -> bool:
        chat = i % 2 == 0
        body = {"model": tiny_model_dir.name, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                **({"messages": [{"role": "user", "content": f"request {i}"}]} if chat else {"prompt": f"req {i}"})}
        async with session.post(base + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
            assert r.status == 200
            for _ in range(100):
                if disconnect and after == 0:
                    r.close()
                    return False
                event = await r.content.readuntil(b"\n\n")
                if event == b"data: [DONE]\n\n":
                    assert await r.read() == b""
                    return True
                after -= 1
        raise AssertionError("no [DONE] after 100 events")

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        completed = await asyncio.gather(*(one(session, i, *plan) for i, plan in enumerate(plans)))
    samples = await wait_until_idle(base)
    total = sum(finished(samples, r) for r in ("stop", "length", "abort", "error"))
    assert total == 200 and finished(samples, "error") == 0 and finished(samples, "abort") > 0
    assert finished(samples, "length") >= sum(completed)
    async with client(base) as c:
        reply = await c.completions.create(model=tiny_model_dir.name, prompt="still alive?", max_tokens=3)
    assert reply.usage.completion_tokens >= 1


async def test_metrics_names_and_values(engines, serve, tiny_model_dir):
    engine = engines("disaggregated")
    base = await serve(engine)
    async with client(base) as c:
        replies = [await c.completions.create(model=tiny_model_dir.name, prompt=f"metrics {i}", max_tokens=4 + i,
                                              extra_body={"ignore_eos": True}) for i in range(3)]
    samples = await wait_until_idle(base)
    names = {name for name, _ in samples}
    for name in ("pdserve_requests_running", "pdserve_requests_waiting", "pdserve_kv_blocks_used",
                 "pdserve_kv_blocks_total", "pdserve_time_to_first_token_seconds_count",
                 "pdserve_inter_token_latency_seconds_count", "pdserve_e2e_request_latency_seconds_count",
                 "pdserve_kv_transfer_seconds_count", "pdserve_prompt_tokens_total",
                 "pdserve_generation_tokens_total", "pdserve_requests_finished_total"):
        assert name in names, name
    assert samples[("pdserve_time_to_first_token_seconds_count", ())] == 3
    assert samples[("pdserve_e2e_request_latency_seconds_count", ())] == 3
    assert samples[("pdserve_inter_token_latency_seconds_count", ())] == sum(3 + i for i in range(3))
    assert samples[("pdserve_generation_tokens_total", ())] == sum(r.usage.completion_tokens for r in replies)
    assert samples[("pdserve_prompt_tokens_total", ())] == sum(r.usage.prompt_tokens for r in replies)
    assert finished(samples, "length") == 3
    blocks = {dict(labels)["actor"]: v for (name, labels), v in samples.items() if name == "pdserve_kv_blocks_total"}
    assert set(blocks) == {"prefill", "decode"} and all(v > 0 for v in blocks.values())
