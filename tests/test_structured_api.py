"""Structured outputs and tool calling through the official `openai` client against a live server on the
default model: answers checked with jsonschema, pydantic and re; the KV handed over mid-grammar
(disaggregated), process workers, and bad requests refused with a 400 that names the field."""
from __future__ import annotations

import json
import re
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from tests.test_server_api import client, scrape, serve, wait_until_idle  # noqa: F401 (serve is a fixture)

ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "priority", "total"],
         "properties": {
             "customer": {"type": "object", "additionalProperties": False, "required": ["name", "vip"],
                          "properties": {"name": {"type": "string", "maxLength": 16}, "vip": {"type": "boolean"}}},
             "items": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
             "priority": {"enum": ["low", "normal", "high"]},
             "total": {"type": "number", "minimum": 0, "maximum": 1000}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "maxLength": 12}}}}}
ASK = [{"role": "user", "content": "Write an order for two lamps as JSON."}]
PERSON_ASK = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=100_000_000)
    landmarks: list[Annotated[str, pydantic.Field(max_length=30)]] = pydantic.Field(max_length=2)   # bounded: 120 tokens hold it


@pytest.fixture(scope="module")
def engines(smollm2):
    built: dict[tuple, Engine] = {}

    def get(mode: str, workers: str = "thread") -> Engine:
        if (mode, workers) not in built:
            built[mode, workers] = Engine(EngineConfig(
                model=str(smollm2[1]), mode=mode, workers=workers, cache=CacheConfig(kv_cache_memory="64MiB"),
                scheduler=SchedulerConfig(max_model_len=1024)))
        return built[mode, workers]

    yield get
    for engine in built.values():
        engine.close()


async def chat(c: openai.AsyncOpenAI, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as dicts, finish_reason), streamed chunks assembled by the client's own helper."""
    if not stream:
        choice = (await c.chat.completions.create(model="smollm2", **kwargs)).choices[0]
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    async with c.chat.completions.stream(model="smollm2", **kwargs) as events:
        try:
            final = await events.get_final_completion()
        except openai.LengthFinishReasonError as e:      # the helper refuses to parse a cut answer
            final = e.completion
    choice = final.choices[0]
    calls = [call.model_dump(include={"id", "type", "function"}) for call in choice.message.tool_calls or []]
    for call in calls:
        call["function"] = {k: call["function"][k] for k in ("name", "arguments")}
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("mode, workers", [("disaggregated", "thread"), ("colocated", "thread"),
                                           ("disaggregated", "process"), ("adaptive", "thread")])
@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_answers_validate(engines, serve, mode, workers, stream):
    base = await serve(engines(mode, workers), served_model_names=("smollm2",))
    async with client(base) as c:
        for temperature in (0.0, 1.0):
            content, calls, reason = await chat(c, stream, messages=ASK, response_format=RESPONSE_FORMAT,
                                                max_tokens=120, temperature=temperature, seed=3)
            assert reason == "stop" and not calls
            jsonschema.validate(json.loads(content), ORDER)
        content, _, reason = await chat(c, stream, messages=PERSON_ASK, response_format={"type": "json_object"},
                                        max_tokens=120, temperature=0.0)
        assert reason == "stop" and isinstance(json.loads(content), dict)
    samples = await wait_until_idle(base)
    assert samples[("pdserve_structured_requests_total", (("kind", "json"),))] == 3
    assert samples[("pdserve_grammar_mask_seconds_count", ())] > 0
    assert samples[("pdserve_grammar_compile_seconds_count", ())] == 2        # ORDER and json_object, once each


async def test_parse_returns_the_pydantic_model(engines, serve):
    base = await serve(engines("disaggregated"), served_model_names=("smollm2",))
    async with client(base) as c:
        completion = await c.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}], response_format=City,
            max_tokens=120, temperature=0.0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_every_choice_of_n_follows_the_schema(engines, serve, stream):
    base = await serve(engines("disaggregated"), served_model_names=("smollm2",))
    async with client(base) as c:
        kwargs = dict(model="smollm2", messages=ASK, response_format=RESPONSE_FORMAT, max_tokens=120, n=3,
                      temperature=1.0, presence_penalty=0.5, logprobs=True, top_logprobs=2)
        if stream:
            texts = ["", "", ""]
            async for chunk in await c.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
        else:
            texts = [choice.message.content for choice in (await c.chat.completions.create(**kwargs)).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER)


def check_calls(calls: list[dict], tools: list[dict], one: bool) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls and (len(calls) == 1 or not one)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_tool_choices_return_valid_calls(engines, serve, stream):
    base = await serve(engines("disaggregated"), served_model_names=("smollm2",))
    async with client(base) as c:
        content, calls, reason = await chat(c, stream, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", max_tokens=80, temperature=0.0)
        assert reason == "tool_calls" and not content
        check_calls(calls, [WEATHER, TIME], one=False)
        content, calls, reason = await chat(c, stream, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            parallel_tool_calls=False, max_tokens=80, temperature=0.7, seed=1)
        assert reason == "tool_calls" and not content
        check_calls(calls, [TIME], one=True)
        assert calls[0]["function"]["name"] == "get_time"
        conversation = WEATHER_ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                                      *({"role": "tool", "tool_call_id": call["id"], "content": "22 C"}
                                        for call in calls)]
        content, calls, reason = await chat(c, stream, messages=conversation, tools=[WEATHER, TIME],
                                            tool_choice="none", max_tokens=10, temperature=0.0)
        assert not calls and content and reason == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_tool_choice_reads_the_hermes_format(engines, serve, stream):
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    base = await serve(engines("disaggregated"), served_model_names=("smollm2",))
    async with client(base) as c:
        content, calls, reason = await chat(c, stream, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=60,
                                            temperature=0.0, extra_body={"structured_outputs": {"choice": [said]}})
        assert reason == "tool_calls" and not content
        assert [json.loads(call["function"]["arguments"]) for call in calls] == [{"city": "Paris", "unit": "celsius"}]
        content, calls, reason = await chat(c, stream, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=60,
                                            temperature=0.0, extra_body={"structured_outputs": {"choice": ["Sunny."]}})
        assert (content, calls, reason) == ("Sunny.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
async def test_regex_and_choice_match_on_chat_and_completions(engines, serve, stream):
    base = await serve(engines("disaggregated"), served_model_names=("smollm2",))
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    async with client(base) as c:
        content, _, _ = await chat(c, stream, messages=ASK, max_tokens=20, temperature=1.0, seed=5,
                                   extra_body={"structured_outputs": {"regex": pattern}})
        assert re.fullmatch(pattern, content)
        content, _, _ = await chat(c, stream, messages=ASK, max_tokens=20, temperature=1.0, seed=5,
                                   extra_body={"guided_choice": ["yes", "no", "maybe"]})
        assert content in ("yes", "no", "maybe")
        kwargs = dict(model="smollm2", prompt="The answer is", max_tokens=20, temperature=0.0,
                      extra_body={"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}})
        if stream:
            text = "".join([chunk.choices[0].text async for chunk in await c.completions.create(stream=True, **kwargs)])
        else:
            text = (await c.completions.create(**kwargs)).choices[0].text
        assert re.fullmatch(r"x[0-9]{2}", text)


@pytest.mark.parametrize("stream", [False, True])
async def test_logit_bias_plus_100_makes_greedy_output_that_token(engines, serve, stream):
    engine = engines("disaggregated")
    token = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    base = await serve(engine, served_model_names=("smollm2",))
    async with client(base) as c:
        _, _, _ = await chat(c, stream, messages=ASK, max_tokens=1, temperature=0.0)
        if stream:
            chunks = await c.completions.create(model="smollm2", prompt="Hello", max_tokens=5, temperature=0.0,
                                                logit_bias={str(token): 100}, logprobs=0, stream=True)
            tokens = [t async for chunk in chunks for t in (chunk.choices[0].logprobs.tokens if chunk.choices and
                                                            chunk.choices[0].logprobs else [])]
        else:
            tokens = (await c.completions.create(model="smollm2", prompt="Hello", max_tokens=5, temperature=0.0,
                                                 logit_bias={str(token): 100}, logprobs=0)).choices[0].logprobs.tokens
    assert tokens == [engine.tokenizer.decode([token], skip_special_tokens=False)] * 5


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs.regex"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
]


@pytest.mark.parametrize("extra, param", BAD)
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(engines, serve, extra, param):
    base = await serve(engines("disaggregated"), served_model_names=("smollm2",))
    async with client(base) as c:
        with pytest.raises(openai.BadRequestError) as raised:
            await c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, extra_body=extra)
    assert raised.value.body["param"] == param, raised.value.body
    samples = await wait_until_idle(base)
    assert not any(v for k, v in samples.items() if k[0] == "pdserve_kv_blocks_used")
