"""vLLM's /tokenize, /detokenize and /version, with its request and response shapes."""
from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Any

import orjson
from aiohttp import web

from pdserve.server.chat_options import parse_chat_options
from pdserve.server.chat_prompt import render_chat
from pdserve.server.errors import bad_request
from pdserve.server.protocol import load_json_object, parse_chat
from pdserve.server.state import STATE, ServerState
from pdserve.server.tool_calls import choose_parser

OFF_LOOP_CHARS = 64 * 1024          # longer texts, and as many token ids, are handled in a worker thread


async def tokenize(request: web.Request) -> web.Response:
    """`{prompt}` or `{messages}` (with the chat template options) -> `{count, max_model_len, tokens,
    token_strs}`; `token_strs` (the vocabulary's pieces) only with `return_token_strs`."""
    state = request.app[STATE]
    engine = state.running_engine()
    body = load_json_object(await request.read())
    state.check_model(_optional(body, "model", str, "a string"))
    with_strs = _optional(body, "return_token_strs", bool, "a boolean") or False
    if body.get("messages") is not None:
        ids = await _chat_ids(state, body)
    elif body.get("prompt") is not None:
        prompt = _optional(body, "prompt", str, "a string")
        add_special = _optional(body, "add_special_tokens", bool, "a boolean")
        ids = await _off_loop(len(prompt), state.tokenizer.encode, prompt, add_special is not False)
    else:
        raise bad_request("give prompt (a string) or messages (an array of message objects)", "prompt")
    strs = [state.tokenizer.id_to_token(t) for t in ids] if with_strs else None
    return _json({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids),
                  "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """`{tokens}` -> `{prompt}`: the text of the ids, special tokens included (what /tokenize was given)."""
    state = request.app[STATE]
    state.running_engine()
    body = load_json_object(await request.read())
    state.check_model(_optional(body, "model", str, "a string"))
    tokens = body.get("tokens")
    vocab = state.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise bad_request(f"tokens must be an array of token ids, integers in [0, {vocab})", "tokens")
    text = await _off_loop(len(tokens), state.tokenizer.decode, tokens, False)
    return _json({"prompt": text})


async def version(request: web.Request) -> web.Response:
    try:
        number = package_version("pdserve")
    except PackageNotFoundError:
        number = "unknown"
    return _json({"version": number})


async def _chat_ids(state: ServerState, body: dict) -> list[int]:
    parsed = parse_chat(body, state.config.limits)
    options = parse_chat_options(body)
    add_special = _optional(body, "add_special_tokens", bool, "a boolean") or False
    tokenizer = state.tokenizer
    parser = choose_parser(tokenizer.chat_template, state.tool_call_parser)
    size = sum(len(m["content"]) for m in parsed.messages)
    text = await _off_loop(size, render_chat, tokenizer, parsed, parser, options)
    return await _off_loop(len(text), tokenizer.encode, text, add_special)


def _optional(body: dict, name: str, kind: type, description: str) -> Any:
    value = body.get(name)
    if value is not None and (type(value) is not kind):
        raise bad_request(f"{name} must be {description}, got {type(value).__name__}", name)
    return value


async def _off_loop(size: int, fn, *args):
    return await asyncio.to_thread(fn, *args) if size > OFF_LOOP_CHARS else fn(*args)


def _json(obj: dict) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")
