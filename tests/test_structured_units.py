"""The pieces of structured outputs without a server: tool-call formats read back, streamed text held
back while a call may be starting, the template conversation checked against transformers, and the
bitmask unpacking against llguidance's own."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from llguidance.numpy import apply_token_bitmask_inplace

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.worker.sampling.constraints import unpack_bitmask
from pdserve.server.tool_call_stream import ToolCallStream
from pdserve.server.tool_calls import Tools, choose_parser, parse_auto, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOLS = Tools((WEATHER,), "auto")
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def test_hermes_calls_are_read_with_the_content_before_them():
    content, calls = parse_auto(f"Let me check.\n<tool_call>\n{CALL}\n</tool_call><tool_call>{CALL}", "hermes",
                                TOOLS.names)
    assert content == "Let me check." and [json.loads(c.arguments) for c in calls] == [{"city": "Oslo"}] * 2
    assert parse_auto("<tool_call>{\"name\": \"other\", \"arguments\": {}}</tool_call>", "hermes", TOOLS.names)[1] == []


def test_llama3_json_calls_are_read_and_prose_stays_content():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; ' \
           '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    content, calls = parse_auto(text, "llama3_json", TOOLS.names)
    assert content == "" and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    assert parse_auto("{not json", "llama3_json", TOOLS.names) == ("{not json", [])


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_stream_never_shows_any_part_of_a_call(cut):
    text = f"Sure.<tool_call>\n{CALL}\n</tool_call>"
    stream = ToolCallStream(TOOLS, "hermes")
    shown = "".join(stream.feed(text[i:i + cut])[0] for i in range(0, len(text), cut))
    rest, calls = stream.finish()
    assert shown + rest == "Sure." and len(calls) == 0 and stream.sent == 1
    early = ToolCallStream(TOOLS, "hermes")
    assert early.feed(text)[1][0]["function"]["name"] == "get_weather" and early.feed("<tool_call>" + CALL)[1] == []
    assert len(early.finish()[1]) == 1 and early.sent == 2          # the unclosed last one, at the end
    plain = ToolCallStream(TOOLS, "hermes")
    assert "".join(plain.feed(c)[0] for c in "a <tool b") + plain.finish()[0] == "a <tool b"


@pytest.mark.parametrize("cut", [1, 5, 1000])
def test_a_forced_stream_sends_arguments_as_they_are_written(cut):
    first, second = '{"name":"get_weather","arguments":{"city":"Os\\"lo}","n":[1,{"a":"]"}]}}', \
        '{"name":"get_weather","arguments":{}}'
    text = f"[{first},{second}]"
    stream, entries = ToolCallStream(Tools((WEATHER,), "required"), "hermes"), []
    for i in range(0, len(text), cut):
        content, deltas = stream.feed(text[i:i + cut])
        assert content == "" and len({d["index"] for d in deltas}) == len(deltas)     # one entry per call
        entries += [(i + cut, d) for d in deltas]
    assert stream.finish() == ("", [])
    heads = [(at, d) for at, d in entries if "id" in d]
    assert [(d["index"], d["type"], d["function"]["name"]) for _, d in heads] == [(0, "function", "get_weather"),
                                                                                (1, "function", "get_weather")]
    assert heads[0][0] < len(first) // 2 + cut          # the name went out before the arguments were written
    arguments = ["".join(d["function"]["arguments"] for _, d in entries if d["index"] == k) for k in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": 'Os"lo}', "n": [1, {"a": "]"}]}, {}]
    if cut == 1:
        assert len([d for _, d in entries if d["index"] == 0]) > 10         # fragment by fragment
    cut_short = ToolCallStream(Tools((WEATHER,), "required"), "hermes")
    assert cut_short.feed('[{"name":"get_wea')[1] == [] and cut_short.finish() == ('[{"name":"get_wea', [])


def test_streamed_forced_calls_assemble_in_the_openai_client_as_the_response_has_them():
    """Chunks of ChatFormat fed to the official client's own stream assembly give the non-streamed calls."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from pdserve.server.openai_format import ChatFormat, Choice, Delta

    tools = Tools((WEATHER,), "required")
    text = '[{"name":"get_weather","arguments":{"city":"Oslo","days":[1,2]}},{"name":"get_weather","arguments":{}}]'
    chat = ChatFormat("chatcmpl-1", "smollm2", 0, str, tools)
    state = ChatCompletionStreamState()
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    chunks = [chat.first_chunk(0)] + [chat.chunk(0, Delta(piece), False, "stop" if i == len(pieces) - 1 else None)
                                      for i, piece in enumerate(pieces)]
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    whole = ChatFormat("chatcmpl-1", "smollm2", 0, str, tools).response(
        [Choice(0, 0, text=[text], finish_reason="stop")], {}, False)["choices"][0]
    assert streamed.finish_reason == whole["finish_reason"] == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    assert sum(1 for chunk in chunks for d in chunk["choices"][0]["delta"].get("tool_calls", ()) if d["index"] == 0) > 3


def test_the_parser_follows_the_template():
    assert choose_parser("{{ '<|python_tag|>' }}", None) == "llama3_json"
    assert choose_parser("<|im_start|>", None) == "hermes"
    assert choose_parser("<|im_start|>", "llama3_json") == "llama3_json"


TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}:{{ c.function.arguments | tojson }}</call>"
    "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}<|assistant|>")


def test_a_template_that_knows_tools_renders_them_as_transformers_does(smollm2):
    messages = ({"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "3 C", "tool_call_id": "call_1"})
    loaded = Tokenizer.from_dir(smollm2[1])
    ours = Tokenizer(loaded.backend, {}, loaded.eos_token_ids, TOOL_TEMPLATE, smollm2[1])
    rendered, tools = template_messages(messages, TOOLS, TOOL_TEMPLATE, "hermes")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smollm2[1] / "tokenizer.json"))
    hf_messages = [dict(messages[0]), {**messages[1], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                   dict(messages[2])]
    expected = reference.apply_chat_template(hf_messages, tools=[WEATHER], chat_template=TOOL_TEMPLATE,
                                             tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(rendered, tools=tools) == expected
    assert '<call>get_weather:{"city": "Oslo"}</call>' in expected


def test_a_template_without_tools_gets_them_in_the_parser_format():
    messages = ({"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "3 C", "tool_call_id": "c"})
    rendered, tools = template_messages(messages, TOOLS, "<|im_start|>{{ messages }}", "hermes")
    assert tools is None and rendered[0]["role"] == "system" and '"get_weather"' in rendered[0]["content"]
    assert parse_auto(rendered[2]["content"], "hermes", TOOLS.names)[1][0].name == "get_weather"
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n3 C\n</tool_response>"}


def test_bitmask_unpacking_matches_llguidance():
    generator = np.random.default_rng(0)
    vocab = 1000
    bitmask = generator.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = generator.standard_normal((3, vocab)).astype(np.float32)
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, bitmask)
    ours = torch.from_numpy(logits).masked_fill(~unpack_bitmask(torch.from_numpy(bitmask), vocab), float("-inf"))
    assert np.array_equal(ours.numpy(), expected)


def test_grammar_and_logit_bias_cross_the_process_boundary_once_per_row():
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.text.grammar import regex_grammar
    from pdserve.engine.worker.processes import wire
    from pdserve.engine.worker.step import NewRow, StepInput, StepResult, StepWork
    from pdserve.engine.worker.step_runner import StepOutcome

    params = SamplingParams(max_tokens=9, temperature=0.5, grammar=regex_grammar("[0-9]+"),
                            logit_bias=((3, -100.0), (17, 2.5)))
    work = StepWork(StepInput(new_rows=(NewRow(4, (1, 2, 3, 9), 3, (7,), params),)))
    assert wire.decode_work(wire.encode_work(work)) == work
    outcome = StepOutcome(StepResult((5,)), (), 0.01, 2, mask_seconds=0.002)
    assert wire.decode_outcome(wire.encode_outcome(outcome)) == outcome


def test_the_serve_command_takes_a_tool_call_parser(monkeypatch):
    import dataclasses

    from pdserve.server import cli

    seen = []
    monkeypatch.setitem(cli.COMMANDS, "serve", dataclasses.replace(cli.COMMANDS["serve"],
                                                                  run=lambda args: seen.append(args) or 0))
    assert cli.main(["serve", "--tool-call-parser", "llama3_json"]) == 0 and cli.main(["serve"]) == 0
    assert [cli.server_config_from_args(a).tool_call_parser for a in seen] == ["llama3_json", None]
    with pytest.raises(SystemExit):
        cli.main(["serve", "--tool-call-parser", "mistral"])


def test_outputs_follow_the_request_s_property_order(smollm2):
    from llguidance import LLMatcher

    from pdserve.engine.text.grammar import grammar_tokenizer
    from pdserve.server.structured import build_grammar, output_format
    from pdserve.server.tool_calls import forced_format

    loaded = Tokenizer.from_dir(smollm2[1])
    tokenizer = grammar_tokenizer(smollm2[1], 49152, tuple(sorted(loaded.eos_token_ids)))

    def forced_start(fmt) -> str:
        return loaded.decode(LLMatcher(tokenizer, build_grammar(fmt)).compute_ff_tokens())

    schema = {"type": "object", "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "string"}, "alpha": {"type": "string"}}}
    fmt = output_format({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert forced_start(fmt).startswith('{"zeta')
    assert forced_start(forced_format(Tools((WEATHER,), "required"))).startswith('[{"name')
