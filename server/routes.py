"""HTTP handlers and the one place where routes are registered."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import orjson
from aiohttp import web

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.server.chat_options import ChatOptions, parse_chat_options
from pdserve.server.chat_page import chat_page
from pdserve.server.chat_prompt import chat_prompt_ids
from pdserve.server.errors import APIError
from pdserve.server.generation import Generation
from pdserve.server.metrics import CONTENT_TYPE
from pdserve.server.openai_format import ChatFormat, CompletionFormat, Reasoning, TokenText
from pdserve.server.protocol import (
    ParsedRequest,
    load_json_object,
    parse_chat,
    parse_completion,
)
from pdserve.server.sampling_defaults import with_defaults
from pdserve.server.state import ACCESS, STATE, AccessRecord, ServerState
from pdserve.server.tokenization import detokenize, tokenize, version
from pdserve.server.tool_calls import choose_parser

OFF_LOOP_TOKENIZE_CHARS = 64 * 1024     # longer prompts are tokenized in a worker thread


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", chat_page)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.running_engine()
    tokenizer = state.tokenizer
    body = load_json_object(await request.read())
    parsed = with_defaults(parse_chat(body, state.config.limits), state.sampling_defaults)
    options = parse_chat_options(body)
    model = state.check_model(parsed.model)
    parser = choose_parser(tokenizer.chat_template, state.tool_call_parser)
    size = sum(len(m["content"]) for m in parsed.messages)
    prompt = await _off_loop_if(size, chat_prompt_ids, tokenizer, parsed, parser, options)
    parsed = await _with_grammar(state, parsed)
    fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time()), TokenText(tokenizer),
                     parsed.tools, parser, await _reasoning(state, tokenizer, prompt, options), parsed.prompt_logprobs)
    return await _generate(request, parsed, [prompt], [""], fmt)


async def _reasoning(state: ServerState, tokenizer: Tokenizer, prompt: tuple[int, ...],
                     options: ChatOptions) -> Reasoning | None:
    """How this request's output splits into reasoning and content; None without --reasoning-parser."""
    if state.reasoning is None:
        return None
    text = await _off_loop_if(len(prompt), tokenizer.decode, prompt, False)
    return Reasoning(state.reasoning.in_reasoning_at_start(text, options.template_kwargs), options.include_reasoning)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.running_engine()
    tokenizer = state.tokenizer
    parsed = parse_completion(load_json_object(await request.read()), state.config.limits)
    parsed = with_defaults(parsed, state.sampling_defaults)
    model = state.check_model(parsed.model)
    size = sum(len(p) for p in parsed.prompts if isinstance(p, str))
    prompts = await _off_loop_if(size, _encode_prompts, tokenizer, parsed)
    parsed = await _with_grammar(state, parsed)
    echoes = [_echo(tokenizer, p) if parsed.echo else "" for p in parsed.prompts]
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", model, int(time.time()), TokenText(tokenizer),
                           parsed.sampling.get("logprobs") if parsed.echo else None, parsed.prompt_logprobs)
    return await _generate(request, parsed, prompts, echoes, fmt)


async def _generate(request: web.Request, parsed: ParsedRequest, prompts: list[tuple[int, ...]],
                    echoes: list[str], fmt: ChatFormat | CompletionFormat) -> web.StreamResponse:
    access = request.get(ACCESS) or AccessRecord()
    generation = Generation(request.app[STATE], parsed, prompts, echoes, fmt, fmt.head["id"], access)
    generation.submit()
    try:
        if parsed.stream:
            return await generation.stream(request)
        return await generation.collect()
    finally:
        await generation.close()


async def _off_loop_if(size: int, fn: Callable, *args):
    if size > OFF_LOOP_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _with_grammar(state: ServerState, parsed: ParsedRequest) -> ParsedRequest:
    """`parsed` with its output format's grammar (compiled off the loop, cached) in its sampling parameters."""
    grammar = await state.grammars.grammar(parsed.output) if parsed.output is not None else None
    if parsed.sampling.get("logit_bias"):
        state.metrics.structured.labels("logit_bias").inc()
    if grammar is None:
        return parsed
    state.metrics.structured.labels("tools" if parsed.output.param == "tools" else parsed.output.kind).inc()
    return replace(parsed, sampling={**parsed.sampling, "grammar": grammar})


def _encode_prompts(tokenizer: Tokenizer, parsed: ParsedRequest) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(p)) if isinstance(p, str) else p for p in parsed.prompts]


def _echo(tokenizer: Tokenizer, prompt: str | tuple[int, ...]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.running_engine()
    created = int(engine.model_dir.stat().st_mtime)
    data = {"id": state.model_names[0], "object": "model", "created": created, "owned_by": "pdserve",
            "root": str(engine.model_dir), "max_model_len": engine.max_model_len}
    return _json({"object": "list", "data": [data]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    if engine is not None and engine.dead is not None:
        raise APIError(503, f"the engine is dead: {engine.dead}")
    if state.draining:
        raise APIError(503, "the server is shutting down", retry_after=state.config.retry_after)
    if engine is None or not engine.healthy():
        reason = "restarting its actors after a failure" if engine and engine.supervisor.recovering else "not running"
        raise APIError(503, f"the engine is {reason}", retry_after=state.config.retry_after)
    units = engine.units_up()                  # a unit down (restarting, or retired: why) makes it degraded
    status = "ok" if all(unit["up"] for unit in units) else "degraded"
    return _json({"status": status, "mode": engine.mode.name, "units": units})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _json(obj: dict, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")
