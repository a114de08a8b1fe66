"""Abuse bounds and prefix-cache fields of a request: `stop`, `logit_bias`, `cache_salt`, n x max_tokens,
client `priority` (only with --allow-client-priority), and `usage.prompt_tokens_details.cached_tokens`;
parsed alone and through a live server with the official `openai` client."""
from __future__ import annotations

import uuid

import openai
import pytest

from pdserve.server.config import RequestLimits
from pdserve.server.errors import APIError
from pdserve.server.protocol import MAX_CACHE_SALT_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, parse_chat, parse_completion
from tests.test_server_api import (
    USER,
    client,
    engines,
    finished,
    serve,
    wait_until_idle,  # noqa: F401  (fixtures)
)

LIMITS = RequestLimits()
CHAT = {"messages": USER}


def _error(parse, body: dict, limits: RequestLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, limits)
    assert e.value.status == 400
    return e.value


# parsing alone

def test_stop_takes_at_most_16_strings_of_at_most_256_characters():
    most = [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["x" * MAX_STOP_CHARS]
    assert parse_chat(CHAT | {"stop": most}, LIMITS).sampling["stop"] == tuple(most)
    too_many = _error(parse_chat, CHAT | {"stop": most + ["one more"]})
    too_long = _error(parse_completion, {"prompt": "p", "stop": "y" * (MAX_STOP_CHARS + 1)})
    assert too_many.param == too_long.param == "stop"
    assert "at most 16 strings, got 17" in too_many.message and "at most 256 characters, got 257" in too_long.message


def test_logit_bias_within_openais_limits_is_parsed_and_anything_else_refused():
    parsed = parse_chat(CHAT | {"logit_bias": {"50": 5, "7": -100}}, LIMITS).sampling["logit_bias"]
    assert parsed == ((7, -100.0), (50, 5.0))
    assert parse_chat(CHAT | {"logit_bias": {}}, LIMITS).sampling.get("logit_bias") in (None, ())   # no bias
    for bad in ([1], {"50": 100.5}, {"-1": 1}, {"x": 1}, {str(i): 1 for i in range(301)}):
        assert _error(parse_chat, CHAT | {"logit_bias": bad}).param == "logit_bias"
        assert _error(parse_completion, {"prompt": "p", "logit_bias": bad}).param == "logit_bias"


def test_cache_salt_is_a_short_non_empty_string():
    salt = "tenant-" + "a" * (MAX_CACHE_SALT_CHARS - 7)
    assert parse_chat(CHAT | {"cache_salt": salt}, LIMITS).cache_salt == salt
    assert parse_completion({"prompt": "p"}, LIMITS).cache_salt is None
    for bad in ("", salt + "b", 7, ["a"]):
        assert _error(parse_chat, CHAT | {"cache_salt": bad}).param == "cache_salt"


def test_priority_is_validated_always_and_used_only_when_allowed():
    allowed = RequestLimits(allow_client_priority=True)
    assert parse_chat(CHAT | {"priority": 9}, LIMITS).priority == 0
    assert parse_chat(CHAT | {"priority": 9}, allowed).priority == 9
    assert parse_completion({"prompt": "p", "priority": -3}, allowed).priority == -3
    for limits in (LIMITS, allowed):
        assert _error(parse_chat, CHAT | {"priority": "high"}, limits).param == "priority"


def test_n_times_max_tokens_over_every_prompt_is_bounded():
    limits = RequestLimits(max_n=8, max_total_tokens=60)
    at_limit = parse_completion({"prompt": ["a", "b"], "n": 3, "max_tokens": 10}, limits)
    assert at_limit.sampling_params(prompt_len=5, max_model_len=1000).max_tokens == 10
    over = _error(parse_completion, {"prompt": ["a", "b"], "n": 3, "max_tokens": 11}, limits)
    assert over.param == "max_tokens" and "3 x 2 prompts x 11 = 66 tokens" in over.message and "60" in over.message
    chat = _error(parse_chat, CHAT | {"max_completion_tokens": 61}, limits)
    assert chat.param == "max_completion_tokens"
    implicit = parse_chat(CHAT | {"n": 8}, limits)                        # no max_tokens: 60 // 8 per choice
    assert implicit.sampling_params(prompt_len=5, max_model_len=1000).max_tokens == 7
    assert implicit.sampling_params(prompt_len=996, max_model_len=1000).max_tokens == 4   # the window is smaller
    assert _error(parse_completion, {"prompt": [[1]] * 61}, limits).param == "n"


# through the HTTP API

def _recording_submits(engine, monkeypatch) -> list:
    seen, submit = [], engine.submit
    monkeypatch.setattr(engine, "submit", lambda request: seen.append(request) or submit(request))
    return seen


async def test_bounds_are_400s_naming_the_field_and_nothing_leaks(engines, serve, tiny_model_dir):
    base = await serve(engines("disaggregated"), limits=RequestLimits(max_total_tokens=40))
    name = tiny_model_dir.name
    async with client(base) as c:
        cases = [
            (c.chat.completions.create(model=name, messages=USER, stop=[f"s{i}" for i in range(17)]), "stop"),
            (c.completions.create(model=name, prompt="p", stop="z" * 257), "stop"),
            (c.chat.completions.create(model=name, messages=USER, logit_bias={"5": 101}), "logit_bias"),
            (c.completions.create(model=name, prompt="p", extra_body={"cache_salt": "s" * 257}), "cache_salt"),
            (c.chat.completions.create(model=name, messages=USER, logprobs=True, top_logprobs=21), "top_logprobs"),
            (c.completions.create(model=name, prompt="p", n=4, max_tokens=11), "max_tokens"),
            (c.completions.create(model=name, prompt=["p", "q"], n=3, max_tokens=7), "max_tokens"),
            (c.chat.completions.create(model=name, messages=USER, max_completion_tokens=41), "max_completion_tokens"),
        ]
        for call, param in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await call
            assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", e.value.body
        at_limit = await c.completions.create(model=name, prompt="p", n=4, max_tokens=10, stop=["x" * 256],
                                              logit_bias={}, extra_body={"ignore_eos": True, "cache_salt": "t1"})
        implicit = await c.completions.create(model=name, prompt="p", n=2, extra_body={"ignore_eos": True})
    assert at_limit.usage.completion_tokens == 40
    assert [ch.finish_reason for ch in implicit.choices] == ["length"] * 2
    assert implicit.usage.completion_tokens == 40                         # 40 // 2 a choice, not the window
    samples = await wait_until_idle(base)
    assert finished(samples, "abort") == 0 and finished(samples, "length") == 6


@pytest.mark.parametrize("allow", [False, True])
async def test_client_priority_and_cache_salt_reach_the_engine(engines, serve, tiny_model_dir, monkeypatch, allow):
    engine = engines("colocated")
    seen = _recording_submits(engine, monkeypatch)
    base = await serve(engine, limits=RequestLimits(allow_client_priority=allow))
    async with client(base) as c:
        await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=2,
                                        extra_body={"priority": 7, "cache_salt": "tenant-a"})
        await c.completions.create(model=tiny_model_dir.name, prompt=["a", "b"], max_tokens=2, n=2,
                                   extra_body={"priority": -2})
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=tiny_model_dir.name, prompt="a", extra_body={"priority": 1.5})
    assert e.value.body["param"] == "priority"
    assert [r.priority for r in seen] == ([7] + [-2] * 4 if allow else [0] * 5)
    assert [r.cache_salt for r in seen] == ["tenant-a"] + [None] * 4


class CachedEvents:
    """An engine stream whose first event says `cached` prompt tokens came from the prefix cache."""

    def __init__(self, stream, cached: int) -> None:
        self.stream, self.cached, self.first = stream, cached, True
        self.request_id = stream.request_id

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = await anext(self.stream)
        cached, self.first = (self.cached if self.first else 0), False
        return event._replace(num_cached_tokens=cached)

    async def aclose(self) -> None:
        await self.stream.aclose()


def _cached(request, by_choice: dict[str, int]) -> int:
    parts = request.request_id.split("-")                  # "cmpl-<hex>", or "cmpl-<hex>-<choice>" with several
    return by_choice[parts[2]] if len(parts) == 3 else 6


async def test_cached_tokens_in_usage_streamed_and_whole(engines, serve, tiny_model_dir, monkeypatch):
    engine = engines("disaggregated")
    base = await serve(engine)
    prompts = ["the prefix cache keeps every full block", "of a conversation for its next turn to reuse"]
    async with client(base) as c:
        fresh = f"never sent before {uuid.uuid4().hex} " * 4             # no shared prefix, not even a template
        plain = await c.completions.create(model=tiny_model_dir.name, prompt=fresh, max_tokens=2)
        by_choice = {"0": 5, "1": 3, "2": 7, "3": 9}                    # choice index -> cached tokens
        submit = engine.submit
        monkeypatch.setattr(engine, "submit", lambda r: CachedEvents(submit(r), _cached(r, by_choice)))
        whole = await c.completions.create(model=tiny_model_dir.name, prompt=prompts, n=2, max_tokens=3)
        stream = await c.completions.create(model=tiny_model_dir.name, prompt=prompts, n=2, max_tokens=3,
                                            stream=True, stream_options={"include_usage": True})
        streamed = [chunk async for chunk in stream][-1].usage
        chat = await c.chat.completions.create(model=tiny_model_dir.name, messages=USER, max_tokens=2, stream=True,
                                               stream_options={"include_usage": True})
        chat_usage = [chunk async for chunk in chat][-1].usage
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert all(len(engine.tokenizer.encode(p)) >= 9 for p in prompts)
    for usage in (whole.usage, streamed):
        assert usage.prompt_tokens_details.cached_tokens == 3 + 7        # per prompt the fewest of its choices
    assert chat_usage.prompt_tokens_details.cached_tokens == 6
    await wait_until_idle(base)


@pytest.mark.parametrize("mode", ["adaptive", "disaggregated", "colocated"])
async def test_a_resent_prompt_reports_the_real_prefix_cache_hits_and_a_salt_opts_out(engines, serve,
                                                                                       tiny_model_dir, mode):
    engine = engines(mode)
    base = await serve(engine)
    block = engine.config.cache.block_size
    history = f"turn one of conversation {uuid.uuid4().hex}: " + "the history is sent again every turn " * 12
    assert len(engine.tokenizer.encode(history)) > 3 * block
    async with client(base) as c:
        async def cached(**extra) -> int:
            reply = await c.completions.create(model=tiny_model_dir.name, prompt=history, max_tokens=2,
                                               **({"extra_body": extra} if extra else {}))
            return reply.usage.prompt_tokens_details.cached_tokens
        first, again = await cached(), await cached()
        other_tenant, same_tenant_twice = await cached(cache_salt="tenant-b"), await cached(cache_salt="tenant-b")
    assert first == 0
    assert again > 0 and again % block == 0 and again >= 3 * block
    assert other_tenant == 0                                            # a salt never matches unsalted blocks
    assert same_tenant_twice == again                                   # but matches its own
    await wait_until_idle(base)
