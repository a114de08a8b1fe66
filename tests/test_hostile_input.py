"""Every field of both routes is hostile input: a seeded fuzz (extreme integers, NaN and infinities, wrong
types, huge strings and lists, broken nested objects) against a served engine in every mode, with n-gram
speculation on and structured outputs and tools among the fields, gets only 2xx and 4xx answers, no actor
restarts, no block left in use, /health 200 and a normal answer after; and the seed that once killed the
server is a 400 naming `seed`, however often it is sent."""
from __future__ import annotations

import asyncio
import copy
import json
import random
import re
from pathlib import Path

import aiohttp
import orjson
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.speculative import SpeculativeConfig
from pdserve.engine.engine import Engine
from tests.test_engine_modes import assert_pools_free
from tests.test_server_api import serve, wait_until_idle  # noqa: F401  (fixture)

INTS = [0, -1, 2**31, -2**31, 2**31 - 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 - 1, 2**64, 10**30, -10**30]
FLOATS = [1e308, -1e308, -0.0, 5e-324, 1e-300, 0.5, 3.5, 1e-8]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]     # not JSON, but json.dumps writes NaN and Infinity
WRONG = [None, True, False, "", "x", "1", [], {}, [None], {"a": None}, [[]]]
HUGE = ["x" * 100_000, "\U0001F600" * 20_000, list(range(20_000)), [[1] * 10] * 2000,
        {f"k{i}": i for i in range(5000)}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a word",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a"]}
COMMON = {
    "model": ["tiny"], "max_tokens": [1, 6], "min_tokens": [2], "temperature": [0, 0.7, 1.5], "top_p": [0.9],
    "top_k": [5, -1], "min_p": [0.1], "seed": [7, -3], "presence_penalty": [0.5], "frequency_penalty": [-0.5],
    "repetition_penalty": [1.2], "n": [2], "stop": ["\n", ["ab", "c"]], "stop_token_ids": [[5, 9]],
    "ignore_eos": [True], "skip_special_tokens": [False], "priority": [3], "cache_salt": ["tenant-a"],
    "logit_bias": [{"5": 10, "17": -100}], "stream": [True], "stream_options": [{"include_usage": True}],
    "user": ["u1"], "response_format": [{"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}],
    "structured_outputs": [{"choice": ["yes", "no"]}, {"regex": "[a-z]{3}"}, {"json": SCHEMA}],
    "guided_choice": [["a", "b"]], "guided_regex": ["[0-9]+"], "guided_json": [SCHEMA],
    "guided_grammar": ['root ::= "a" | "b"'],
}
CHAT = {**COMMON, "messages": [[{"role": "user", "content": "hi"}],
                               [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                               [{"role": "user", "content": "find x"},
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {"id": "c1", "type": "function",
                                     "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
                                {"role": "tool", "tool_call_id": "c1", "content": "x is a letter"}]],
        "max_completion_tokens": [5], "logprobs": [True], "top_logprobs": [3], "tools": [TOOLS],
        "tool_choice": ["auto", "required", "none", {"type": "function", "function": {"name": "lookup"}}],
        "parallel_tool_calls": [False], "functions": [[{"name": "f"}]], "function_call": ["auto"],
        "chat_template_kwargs": [{"enable_thinking": False}, {"x": [1, {"y": "z"}]}], "add_generation_prompt": [False],
        "continue_final_message": [True], "include_reasoning": [False], "chat_template": ["{{ messages }}"],
        "prompt_logprobs": [0, 3]}
COMPLETION = {**COMMON, "prompt": ["hi", ["a", "b"], [5, 6, 7], [[5, 6], [7, 8]]], "logprobs": [2], "echo": [True],
              "suffix": ["x"], "best_of": [1], "prompt_logprobs": [0, 20], "max_tokens": [0, 1, 6]}
TOKENIZE = {"model": ["tiny"], "prompt": ["hi", "x" * 2000], "add_special_tokens": [False], "return_token_strs": [True],
            **{name: CHAT[name] for name in ("messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                                             "continue_final_message", "chat_template")}}
DETOKENIZE = {"model": ["tiny"], "tokens": [[1, 2, 3], list(range(300))]}
ROUTES = (("/v1/chat/completions", CHAT, {"messages": CHAT["messages"][0]}),
          ("/v1/completions", COMPLETION, {"prompt": "hi"}), ("/tokenize", TOKENIZE, {"prompt": "hi"}),
          ("/detokenize", DETOKENIZE, {"tokens": [1, 2, 3]}))
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def test_the_fuzz_covers_every_field_the_server_reads():
    """A new request field joins the fuzz: every body field the routes read is in CHAT or COMPLETION."""
    source = "\n".join(p.read_text() for p in (Path(__file__).parents[1] / "server").glob("*.py"))
    read = set(re.findall(r'\b(?:body|f)\.get(?:_max_tokens)?\("([a-z_]+)"', source))
    read |= set(re.findall(r'"(guided_[a-z]+)"', source))
    sampling = re.search(r"_SAMPLING_FIELDS = \((.*?)\n\)", source, re.S).group(1)
    read |= set(re.findall(r'\("([a-z_]+)", "', sampling))
    fuzzed = set(CHAT) | set(COMPLETION) | set(TOKENIZE) | set(DETOKENIZE)
    assert read and read - {"include_usage"} <= fuzzed, read - fuzzed


def hostile(rng: random.Random):
    pool = rng.choice([INTS, FLOATS, WRONG, HUGE, NON_FINITE])
    return rng.choice(pool)


def broken(value, rng: random.Random):
    """`value` with one leaf (or itself) replaced by a hostile value."""
    if isinstance(value, (list, dict)) and value and rng.random() < 0.6:
        value = copy.deepcopy(value)
        keys = list(range(len(value))) if isinstance(value, list) else list(value)
        key = rng.choice(keys)
        value[key] = broken(value[key], rng)
        return value
    return hostile(rng)


def fuzzed_body(rng: random.Random) -> tuple[str, bytes]:
    route, fields, base = rng.choices(ROUTES, weights=(4, 4, 1, 1))[0]
    body = {"model": "tiny", "max_tokens": 4, **base}
    for name in rng.sample(sorted(fields), min(len(fields), rng.choice([1, 1, 2, 3]))):
        body[name] = rng.choice(fields[name])
        if name == "tool_choice":
            body["tools"] = TOOLS
        if rng.random() < 0.75:
            body[name] = broken(body[name], rng)
    return route, json.dumps(body).encode()


@pytest.fixture(scope="module")
def speculating(tiny_model_dir):
    built: dict[str, Engine] = {}

    def get(mode: str) -> Engine:
        if mode not in built:
            built[mode] = Engine(EngineConfig(model=str(tiny_model_dir), mode=mode, speculative=SPEC,
                                              cache=CacheConfig(kv_cache_memory="64MiB"),
                                              scheduler=SchedulerConfig(max_model_len=256)))
        return built[mode]

    yield get
    for engine in built.values():
        engine.close()


async def post(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, str]:
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.text()


async def assert_serving_and_clean(engine: Engine, base: str, session: aiohttp.ClientSession) -> None:
    await wait_until_idle(base)
    async with session.get(base + "/health") as health:
        assert health.status == 200
    status, text = await post(session, base + "/v1/completions",
                              orjson.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}))
    assert status == 200 and orjson.loads(text)["choices"][0]["finish_reason"] == "length"
    assert engine.supervisor.restarts == 0 and engine.dead is None
    assert all(actor.failure is None for actor in engine.actors)
    await wait_until_idle(base)
    assert_pools_free(engine)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "adaptive"])
async def test_a_seeded_fuzz_of_every_field_gets_no_5xx_and_leaves_the_engine_clean(speculating, serve, mode):
    engine = speculating(mode)
    base = await serve(engine, served_model_names=("tiny",), reasoning_parser="deepseek_r1")
    rng = random.Random(41 + len(mode))
    bodies = [fuzzed_body(rng) for _ in range(160)]
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as session:
        for batch in range(0, len(bodies), 8):                 # eight at a time: rows share the units' steps
            answers = await asyncio.gather(*(post(session, base + route, data)
                                             for route, data in bodies[batch:batch + 8]))
            for (route, data), (status, text) in zip(bodies[batch:batch + 8], answers):
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500 and "server_error" not in text, (route, data[:300], text[:300])
        await assert_serving_and_clean(engine, base, session)
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 20, statuses    # both kinds were exercised


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -2**63 - 1])
async def test_a_seed_past_64_bits_is_a_400_naming_seed_every_time(speculating, serve, seed):
    engine = speculating("adaptive")
    base = await serve(engine, served_model_names=("tiny",))
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "seed": seed}).encode()
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            status, text = await post(session, base + "/v1/completions", body)
            assert status == 400 and orjson.loads(text)["error"]["param"] == "seed", text
        await assert_serving_and_clean(engine, base, session)


async def test_the_seeds_at_the_ends_of_64_bits_serve_and_n_choices_wrap(speculating, serve):
    engine = speculating("colocated")
    base = await serve(engine, served_model_names=("tiny",))
    async with aiohttp.ClientSession() as session:
        for seed in (2**63 - 1, -2**63):
            status, text = await post(session, base + "/v1/completions", orjson.dumps(
                {"model": "tiny", "prompt": "hi", "max_tokens": 4, "seed": seed, "n": 3, "temperature": 1.0}))
            assert status == 200 and len(orjson.loads(text)["choices"]) == 3
        await assert_serving_and_clean(engine, base, session)
    assert SamplingParams(seed=2**63 - 1).for_choice(2).seed == -2**63 + 1


@pytest.mark.parametrize("field,value", [("seed", 2**63), ("seed", -2**63 - 1), ("temperature", float("inf")),
                                         ("temperature", float("nan")), ("temperature", 1e300), ("top_p", float("nan")),
                                         ("max_tokens", 2.5), ("top_k", True), ("stop_token_ids", (2**63,)),
                                         ("logit_bias", ((1, float("nan")),))])
def test_sampling_params_refuse_what_the_runner_cannot_hold_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})
