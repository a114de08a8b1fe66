"""Bad input, limits, overload, engine failures and draining: each gets the right status and an
OpenAI error object, the official client raises the matching exception, and no KV block leaks."""
from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from pdserve.engine.engine import Engine
from pdserve.server.state import STATE
from tests.test_server_api import (
    MAX_MODEL_LEN,
    USER,
    client,
    engine_config,
    engines,
    finished,
    serve,
    wait_until_idle,  # noqa: F401  (fixtures)
)

LONG_TEXT = " ".join(f"word{i}" for i in range(MAX_MODEL_LEN * 2))

CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ({"max_tokens": "12"}, "max_tokens"),
    ({"max_tokens": 4.5}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": "abc"}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"stream": "yes"}, "stream"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"priority": 1.5}, "priority"),
    ({"user": 42}, "user"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": []}},
     "tool_choice"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"priority": 2**64 - 1}, "priority"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"logit_bias": {"9" * 30: 1}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
]

COMPLETION_CASES = [
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [[1, 2], "text"]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": LONG_TEXT}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "no"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_bad_values_are_400_with_param(engines, serve, tiny_model_dir, endpoint):
    engine = engines("disaggregated")
    base = await serve(engine)
    cases = CHAT_CASES if endpoint == "chat" else COMPLETION_CASES
    defaults = ({"messages": USER} if endpoint == "chat" else {"prompt": "hello"}) | {"max_tokens": 4}
    async with client(base) as c:
        create = c.chat.completions.create if endpoint == "chat" else c.completions.create
        for fields, param in cases:
            body = defaults | fields
            with pytest.raises(openai.BadRequestError) as e:
                await create(model=tiny_model_dir.name, **{k: body.pop(k) for k in list(body) if k in
                                                           ("messages", "prompt")}, extra_body=body)
            error = e.value.body
            assert e.value.status_code == 400 and error["param"] == param, (fields, error)
            assert error["type"] == "invalid_request_error" and error["message"], (fields, error)
        ok = await create(model=tiny_model_dir.name, max_tokens=2, **{k: v for k, v in defaults.items() if k !=
                                                                      "max_tokens"},
                          extra_body={"frobnicate": [1, 2], "generation_config": "{}", "suffix": None})
    assert ok.usage.completion_tokens >= 1
    samples = await wait_until_idle(base)
    assert finished(samples, "abort") == 0


async def test_context_window_errors_say_so(engines, serve, tiny_model_dir):
    base = await serve(engines("disaggregated"))
    async with client(base) as c:
        with pytest.raises(openai.BadRequestError) as too_long:
            await c.completions.create(model=tiny_model_dir.name, prompt=LONG_TEXT, max_tokens=1)
        with pytest.raises(openai.BadRequestError) as too_many:
            await c.completions.create(model=tiny_model_dir.name, prompt="hi", max_tokens=MAX_MODEL_LEN)
    for error in (too_long.value, too_many.value):
        assert error.code == "context_length_exceeded" and str(MAX_MODEL_LEN) in error.message


async def test_malformed_bodies_unknown_routes_and_methods(engines, serve):
    base = await serve(engines("disaggregated"))
    async with aiohttp.ClientSession() as session:
        replies = []
        for method, path, data in (("POST", "/v1/chat/completions", b"{not json"),
                                   ("POST", "/v1/completions", b"[1, 2, 3]"),
                                   ("POST", "/v1/completions", b"\xff\xfe"),
                                   ("GET", "/v1/nothing-here", None),
                                   ("GET", "/v1/completions", None)):
            async with session.request(method, base + path, data=data) as response:
                replies.append((response.status, orjson.loads(await response.read())))
    assert [status for status, _ in replies] == [400, 400, 400, 404, 405]
    for _, body in replies:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert replies[0][1]["error"]["code"] == "invalid_json"


async def test_api_key_and_body_limit(engines, serve, tiny_model_dir):
    base = await serve(engines("disaggregated"), api_key="sekrit", max_body_bytes=4096)
    async with client(base, api_key="wrong") as wrong, client(base, api_key="sekrit") as right:
        with pytest.raises(openai.AuthenticationError) as e:
            await wrong.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=1)
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.APIStatusError) as big:
            await right.completions.create(model=tiny_model_dir.name, prompt="x" * 8000, max_tokens=1)
        ok = await right.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=1)
    assert big.value.status_code == 413 and big.value.body["code"] == "request_too_large"
    assert ok.usage.completion_tokens == 1
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json={"prompt": "x"}) as response:
            assert response.status == 401
            assert (await response.json())["error"]["type"] == "invalid_request_error"
        for path in ("/health", "/metrics"):
            async with session.get(base + path) as response:
                assert response.status == 200


async def test_full_queue_is_429_with_retry_after_and_leaks_nothing(serve, tiny_model_dir):
    engine = Engine(engine_config(tiny_model_dir, "colocated", max_queue=1))
    try:
        base = await serve(engine)
        async with client(base) as c:
            with pytest.raises(openai.RateLimitError) as e:
                await c.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=8, n=2)
            ok = await c.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=2)
        assert e.value.response.headers["Retry-After"] == "1"
        assert ok.usage.completion_tokens >= 1
        await wait_until_idle(base)
    finally:
        await serve.close_all()
        engine.close()


async def test_unexpected_exception_is_500_and_the_server_survives(engines, serve, tiny_model_dir, monkeypatch):
    engine = engines("disaggregated")
    base = await serve(engine)

    def broken(*args, **kwargs):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(engine.tokenizer, "encode_chat", broken)
    async with client(base) as c:
        with pytest.raises(openai.InternalServerError) as e:
            await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=2)
        ok = await c.completions.create(model=tiny_model_dir.name, prompt="x", max_tokens=2)
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
    assert "exploded" not in e.value.message
    assert ok.usage.completion_tokens >= 1


async def test_engine_failure_after_streaming_began_is_an_error_event(serve, tiny_model_dir, monkeypatch):
    engine = Engine(engine_config(tiny_model_dir, "disaggregated"))     # its own: every decode step fails
    base = await serve(engine)

    def failing_step(work):
        raise RuntimeError("decode device lost")

    monkeypatch.setattr(engine.units.decoding[0].step_runner, "run", failing_step)
    body = {"model": tiny_model_dir.name, "prompt": "hello", "max_tokens": 8, "ignore_eos": True, "stream": True,
            "logprobs": 0}                                             # every token gets a chunk
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json=body) as response:
            raw = await response.read()
        async with session.post(base + "/v1/completions", json=body | {"stream": False}) as response:
            whole = (response.status, await response.json())
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    first, error = orjson.loads(events[0][6:]), orjson.loads(events[-3][6:])
    assert first["choices"][0]["finish_reason"] is None            # the prefill actor's first token
    assert "decode device lost" in error["error"]["message"] and error["error"]["type"] == "server_error"
    assert whole[0] == 500 and "decode device lost" in whole[1]["error"]["message"]
    samples = await wait_until_idle(base)
    assert finished(samples, "error") == 2
    engine.close()


async def test_drain_finishes_or_aborts_streams_and_refuses_new_requests(engines, serve, tiny_model_dir):
    engine = engines("disaggregated")
    base = await serve(engine)
    state = serve.apps[base][STATE]
    body = {"model": tiny_model_dir.name, "prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            finished_by_itself = await state.drain(timeout=0)
            raw = await response.read()
        async with session.post(base + "/v1/completions", json=body) as refused:
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["type"] == "service_unavailable"
        async with session.get(base + "/health") as health:
            assert health.status == 503
    last = orjson.loads(raw.split(b"\n\n")[-3][6:])
    assert not finished_by_itself and raw.endswith(b"data: [DONE]\n\n")
    assert last["choices"][0]["finish_reason"] == "abort"
    samples = await wait_until_idle(base)
    assert finished(samples, "abort") == 1
