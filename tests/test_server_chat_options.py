"""--reasoning-parser, --generation-config and vLLM's metric names, through the official openai client.

To make the tiny random model write `<think>...</think>`, its output is constrained by a regular expression
(structured outputs); the same request on /v1/completions, which no reasoning parser touches, gives the raw text
the chat answer's reasoning and content must split."""
from __future__ import annotations

import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.sampling_defaults import load_defaults
from tests.qwen3_template import CHAT, GENERATION_DEFAULTS, engine, qwen3_dir  # noqa: F401  (fixtures)
from tests.test_server_api import client, serve  # noqa: F401  (the server fixture)

THINKING = {"structured_outputs": {"regex": "<think>[a-z]{3,12}</think>[a-z ]{3,12}"}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


async def raw_output(base: str, model: str, extra: dict) -> str:
    """The constrained output's text for CHAT rendered with `extra`'s template options, unparsed."""
    async with aiohttp.ClientSession() as session:
        body = {"messages": CHAT, **{k: v for k, v in extra.items() if k == "chat_template_kwargs"}}
        async with session.post(base + "/tokenize", json=body) as response:
            ids = (await response.json())["tokens"]
    async with client(base) as c:
        constraint = {k: v for k, v in extra.items() if k == "structured_outputs"}
        completion = await c.completions.create(model=model, prompt=ids, max_tokens=60, temperature=0,
                                                extra_body=constraint)
    return completion.choices[0].text


async def chat(base: str, model: str, extra: dict, stream: bool):
    """(reasoning_content, content) of a chat answer: the message's, or the stream's deltas joined."""
    async with client(base) as c:
        answer = await c.chat.completions.create(model=model, messages=CHAT, max_tokens=60, temperature=0,
                                                 stream=stream, extra_body=extra)
        if not stream:
            message = answer.choices[0].message
            assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None)
            return getattr(message, "reasoning_content", "absent"), message.content
        reasoning, content, pieces = "", "", 0
        async for chunk in answer:
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                pieces += bool(getattr(choice.delta, "reasoning_content", None))
        assert pieces > 1 or not reasoning                       # reasoning streams too, piece by piece
        return reasoning or None, content or None


@pytest.mark.parametrize("stream", [False, True])
async def test_think_text_arrives_as_reasoning_content(engine, serve, qwen3_dir, stream):
    model = qwen3_dir.name
    base = await serve(engine, reasoning_parser="qwen3")
    raw = await raw_output(base, model, THINKING)
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", raw, re.S).groups()
    assert await chat(base, model, THINKING, stream) == (thought, answer)
    assert await chat(base, model, THINKING | {"include_reasoning": False}, stream) == (None, answer)


@pytest.mark.parametrize("stream", [False, True])
async def test_with_thinking_off_the_whole_output_is_content(engine, serve, qwen3_dir, stream):
    model = qwen3_dir.name
    base = await serve(engine, reasoning_parser="qwen3")
    raw = await raw_output(base, model, THINKING | NO_THINKING)
    assert raw.startswith("<think>")
    assert await chat(base, model, THINKING | NO_THINKING, stream) == (None, raw)


async def test_without_a_reasoning_parser_think_text_stays_in_content(engine, serve, qwen3_dir):
    base = await serve(engine)
    raw = await raw_output(base, qwen3_dir.name, THINKING)
    assert await chat(base, qwen3_dir.name, THINKING, stream=False) == ("absent", raw)


async def test_generation_config_defaults_fill_the_fields_a_request_leaves_out(engine, serve, qwen3_dir):
    model, long = qwen3_dir.name, {"ignore_eos": True}
    async with client(await serve(engine)) as c:                         # --generation-config auto
        defaulted = await c.chat.completions.create(model=model, messages=CHAT, extra_body=long)
        greedy = await c.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=5,
                                                 extra_body=long)
        asked = await c.chat.completions.create(model=model, messages=CHAT, max_tokens=3, extra_body=long)
    assert defaulted.usage.completion_tokens == GENERATION_DEFAULTS["max_new_tokens"] == 5
    assert defaulted.choices[0].message.content == greedy.choices[0].message.content     # temperature 0
    assert asked.usage.completion_tokens == 3
    for setting, override, expected in (("vllm", {"max_new_tokens": 7}, 7), ("auto", {"max_new_tokens": 9}, 9)):
        base = await serve(engine, generation_config=setting, override_generation_config=override)
        async with client(base) as c:
            answer = await c.completions.create(model=model, prompt="The sea", extra_body=long)
        assert answer.usage.completion_tokens == expected


def test_a_bad_generation_config_names_its_file_and_key(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": -1, "top_p": 0.9}')
    with pytest.raises(ValueError, match=r"generation_config.json: temperature must be "):
        load_defaults("auto", tmp_path, {})
    assert load_defaults("vllm", tmp_path, {"top_p": 0.5}).sampling == {"top_p": 0.5}
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 0.3, "top_p": 0.9, "do_sample": true}')
    defaults = load_defaults(str(folder), tmp_path, {"temperature": 0.5, "max_new_tokens": 8})
    assert (defaults.sampling, defaults.max_tokens) == ({"temperature": 0.5, "top_p": 0.9}, 8)


async def scrape(base: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as response:
        text = await response.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_vllm_metric_names_for_dashboards_and_gateways(engine, serve, qwen3_dir):
    base = await serve(engine, served_model_names=("tiny-qwen3",))
    async with client(base) as c:
        answers = [await c.completions.create(model="tiny-qwen3", prompt=f"Sea {i}", max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True}) for i in range(3)]
    labels = (("engine", "0"), ("model_name", "tiny-qwen3"))
    samples = await scrape(base)
    prompt_tokens = sum(a.usage.prompt_tokens for a in answers)
    assert samples[("vllm:num_requests_running", labels)] == samples[("vllm:num_requests_waiting", labels)] == 0
    assert 0 <= samples[("vllm:kv_cache_usage_perc", labels)] <= 1
    assert samples[("vllm:time_to_first_token_seconds_count", labels)] == 3
    assert samples[("vllm:inter_token_latency_seconds_count", labels)] == 3 * 3
    assert samples[("vllm:e2e_request_latency_seconds_count", labels)] == 3
    assert samples[("vllm:request_success_total", tuple(sorted(labels + (("finished_reason", "length"),))))] == 3
    assert samples[("vllm:generation_tokens_total", labels)] == 12
    assert samples[("vllm:prompt_tokens_total", labels)] == prompt_tokens
    assert ("vllm:prefix_cache_queries_total", labels) in samples and ("pdserve_requests_running", ()) in samples
    [(info, value)] = [(dict(k[1]), v) for k, v in samples.items() if k[0] == "vllm:cache_config_info"]
    pool = [a for a in engine.stats().actors if a.name != "prefill"]
    assert value == 1 and info["block_size"] == str(engine.config.cache.block_size)
    assert info["num_gpu_blocks"] == str(sum(a.kv_blocks_total for a in pool))
    only_vllm = await scrape(await serve(engine, metrics_names="vllm"))
    assert only_vllm and all(name.startswith("vllm:") for name, _ in only_vllm)
    only_ours = await scrape(await serve(engine, metrics_names="pdserve"))
    assert only_ours and not any(name.startswith("vllm:") for name, _ in only_ours)
