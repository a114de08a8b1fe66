"""vLLM's extras to the OpenAI API, checked against transformers and the official openai client: /tokenize,
/detokenize, /version, chat template options, sampling defaults from generation_config.json, --reasoning-parser,
and vLLM's metric names."""
from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import pytest

from tests.qwen3_template import CHAT, engine, hf_tokenizer, qwen3_dir  # noqa: F401  (fixtures)
from tests.test_server_api import serve  # noqa: F401  (the server fixture)


def ids_of(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


async def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(base + path, json=body) as response:
        return response.status, await response.json()


# /tokenize, /detokenize, /version

async def test_tokenize_gives_transformers_ids_for_prompts_and_detokenize_inverts_it(engine, serve, hf_tokenizer):
    base = await serve(engine)
    text = "The sea at night, <|im_end|> and a tab\there: naïve café ☕"
    for add_special in (None, True, False):
        body = {"prompt": text, "return_token_strs": True} | ({} if add_special is None else
                                                              {"add_special_tokens": add_special})
        status, answer = await post(base, "/tokenize", body)
        expected = ids_of(hf_tokenizer(text, add_special_tokens=add_special is not False))
        assert status == 200 and answer["tokens"] == expected and answer["count"] == len(expected)
        assert answer["max_model_len"] == engine.max_model_len
        assert answer["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
        assert (await post(base, "/detokenize", {"tokens": expected})) == (200, {"prompt": text})
    status, answer = await post(base, "/tokenize", {"prompt": text})
    assert answer["token_strs"] is None


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
async def test_tokenize_renders_chat_messages_as_transformers_does(engine, serve, hf_tokenizer, kwargs):
    base = await serve(engine)
    renderings = {}
    for add_generation_prompt in (True, False):
        body = {"messages": CHAT, "add_generation_prompt": add_generation_prompt}
        status, answer = await post(base, "/tokenize", body | ({"chat_template_kwargs": kwargs} if kwargs else {}))
        expected = ids_of(hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt,
                                                           tokenize=True, **kwargs))
        assert status == 200 and answer["tokens"] == expected
        status, renderings[add_generation_prompt] = await post(base, "/detokenize", {"tokens": expected})
        assert renderings[add_generation_prompt]["prompt"] == hf_tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    no_thinking = renderings[True]["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert no_thinking == (kwargs == {"enable_thinking": False})     # the switch reached the template


async def test_tokenize_continues_the_final_message_as_transformers_does(engine, serve, hf_tokenizer):
    base = await serve(engine)
    messages = CHAT[:2] + [{"role": "assistant", "content": "Mostly, because"}]
    status, answer = await post(base, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                                    "continue_final_message": True})
    expected = ids_of(hf_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True))
    assert status == 200 and answer["tokens"] == expected
    assert hf_tokenizer.decode(expected).endswith("<|im_start|>assistant\nMostly, because")


async def test_version(engine, serve):
    base = await serve(engine)
    async with aiohttp.ClientSession() as session, session.get(base + "/version") as response:
        body = await response.json()
    from importlib.metadata import version

    assert response.status == 200 and body == {"version": version("pdserve")}


HOSTILE = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "model": 3}, "model"),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}, "model"),
    ("/tokenize", {"messages": {}}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"x" * 100: 1}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {f"k{i}": i for i in range(1000)}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 7 }}"}, "chat_template"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2**70]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"bad name": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "include_reasoning": "no"}, "include_reasoning"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": "yes"}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "x" * 100_000}, "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT[:2] + [{"role": "assistant", "content": " "}],
                              "continue_final_message": True, "add_generation_prompt": False}, "messages"),
]


@pytest.mark.parametrize("path,body,param", HOSTILE,
                         ids=[f"{p}-{param}-{i}" for i, (p, _, param) in enumerate(HOSTILE)])
async def test_every_new_field_is_checked(engine, serve, path, body, param):
    base = await serve(engine, reasoning_parser="qwen3")
    status, answer = await post(base, path, {"max_tokens": 2, **body} if path.startswith("/v1") else body)
    assert status in (400, 404), answer
    assert answer["error"]["param"] == param, answer


async def test_a_huge_prompt_is_tokenized_off_the_loop_and_stays_exact(engine, serve, hf_tokenizer):
    base = await serve(engine)
    text = "waves " * 60_000
    status, answer = await post(base, "/tokenize", {"prompt": text})
    assert status == 200 and answer["tokens"] == ids_of(hf_tokenizer(text))
