"""Parse and validate OpenAI request bodies into typed requests (no tokenizer, no engine).

Unknown fields are ignored; known fields with a wrong type or value raise APIError(400)
naming the field in `param`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from pdserve.engine.core.context_window import ContextLengthExceeded, check_context
from pdserve.engine.core.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from pdserve.server.config import RequestLimits
from pdserve.server.errors import APIError, bad_request
from pdserve.server.prompt_fields import Prompt, messages_of, prompts_of
from pdserve.server.structured import OutputFormat, logit_bias, output_format
from pdserve.server.tool_calls import Tools, forced_format, parse_tools

_KINDS = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("a boolean", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "list": ("an array", lambda v: isinstance(v, list)),
}
_SAMPLING_FIELDS = (
    ("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"),
    ("seed", "int"), ("presence_penalty", "number"), ("frequency_penalty", "number"),
    ("repetition_penalty", "number"), ("ignore_eos", "bool"), ("min_tokens", "int"),
    ("skip_special_tokens", "bool"),
)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_CACHE_SALT_CHARS = 256



@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated chat or completion request; `messages` for chat, `prompts` for completions."""

    kind: str                                # chat | completion
    model: str | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None                   # None: the rest of the context window; 0: echo only (completions)
    max_tokens_param: str
    sampling: dict[str, Any]                 # SamplingParams keyword arguments but max_tokens
    max_tokens_cap: int                      # most output tokens one choice may take (RequestLimits)
    priority: int = 0
    cache_salt: str | None = None
    echo: bool = False
    messages: tuple[dict, ...] = ()
    prompts: tuple[Prompt, ...] = ()
    output: OutputFormat | None = None       # what the output must match (its grammar is compiled later)
    tools: Tools | None = None
    prompt_logprobs: int | None = None       # vLLM's field: prompt_logprobs in the response, with this many top

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo (OpenAI's legacy completions): the prompt comes back, scored; nothing generated."""
        return self.max_tokens == 0

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """SamplingParams for a prompt of `prompt_len` tokens; APIError(400) when it cannot fit."""
        try:
            check_context(prompt_len, self.max_tokens, max_model_len, self.prompt_param, self.max_tokens_param)
        except ContextLengthExceeded as e:
            raise APIError(400, str(e), param=e.param, code="context_length_exceeded") from None
        room = max_model_len - prompt_len
        max_tokens = min(room, self.max_tokens_cap) if self.max_tokens is None else self.max_tokens
        return SamplingParams(max_tokens=max_tokens or 1, **self.sampling)     # NOTE: 0 samples one, not returned


def load_json_object(body: bytes) -> dict:
    """The request body as a JSON object; APIError(400) otherwise."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def parse_chat(body: dict, limits: RequestLimits) -> ParsedRequest:
    f = _Fields(body)
    logprobs, top_logprobs = f.get("logprobs", "bool", False), f.get("top_logprobs", "int")
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    _check_logprobs(top_logprobs, "top_logprobs")
    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(f, (top_logprobs or 0) if logprobs else None)
    prompt_logprobs = sampling["prompt_logprobs"] = _prompt_logprobs(f)
    model, n, stream, include_usage = _common(f, limits)
    max_tokens = f.get_max_tokens(max_tokens_param)
    tools, output = parse_tools(body), output_format(body)
    if tools is not None and tools.forced:
        if output is not None:
            raise bad_request(f"{output.param} cannot be combined with tool_choice {tools.choice!r}", output.param)
        output = forced_format(tools)
    _check_constrained(output, sampling)
    return ParsedRequest("chat", model, n, stream, include_usage, max_tokens, max_tokens_param, sampling,
                         _max_tokens_cap(n, 1, max_tokens, max_tokens_param, limits),
                         _priority(f, limits), _cache_salt(f), messages=messages_of(body.get("messages")),
                         output=output, tools=tools, prompt_logprobs=prompt_logprobs)


def parse_completion(body: dict, limits: RequestLimits) -> ParsedRequest:
    f = _Fields(body)
    logprobs = f.get("logprobs", "int")
    _check_logprobs(logprobs, "logprobs")
    echo = f.get("echo", "bool", False)
    prompt_logprobs = _prompt_logprobs(f)
    model, n, stream, include_usage = _common(f, limits)
    max_tokens = f.get_max_tokens("max_tokens", echo)
    prompts = prompts_of(body.get("prompt"))
    for name in ("tools", "tool_choice"):
        if body.get(name) is not None:
            raise bad_request(f"{name} is only supported on /v1/chat/completions", name)
    sampling, output = _sampling(f, logprobs), output_format(body)
    echoed = logprobs if echo else None             # a legacy echo scores the prompt with the output's logprobs
    sampling["prompt_logprobs"] = max((k for k in (prompt_logprobs, echoed) if k is not None), default=None)
    _check_constrained(output, sampling)
    return ParsedRequest("completion", model, n, stream, include_usage, max_tokens, "max_tokens",
                         sampling, _max_tokens_cap(n, len(prompts), max_tokens, "max_tokens", limits),
                         _priority(f, limits), _cache_salt(f), echo=echo, prompts=prompts, output=output,
                         prompt_logprobs=prompt_logprobs)


def _check_constrained(output: OutputFormat | None, sampling: dict[str, Any]) -> None:
    for name in ("min_tokens", "ignore_eos"):
        if output is not None and sampling.get(name):
            raise bad_request(f"{name} cannot be combined with {output.param}: the grammar decides where the "
                              "output ends", name)


class _Fields:
    def __init__(self, body: dict) -> None:
        self.body = body

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        description, ok = _KINDS[kind]
        if not ok(value):
            raise bad_request(f"{name} must be {description}, got {type(value).__name__}", name)
        if kind == "int" and not INT64_MIN <= value <= INT64_MAX:
            raise bad_request(f"{name} must be a 64-bit integer (from -2**63 to 2**63 - 1), got {value}", name)
        return float(value) if kind == "number" else value

    def get_max_tokens(self, name: str, echo: bool = False) -> int | None:
        """`echo`: 0 is allowed too (the prompt scored, nothing generated)."""
        value = self.get(name, "int")
        if value is not None and value < (0 if echo else 1):
            raise bad_request(f"{name} must be at least 1 (0 only with echo on /v1/completions), got {value}", name)
        return value


def _common(f: _Fields, limits: RequestLimits) -> tuple[str | None, int, bool, bool]:
    model, n, stream = f.get("model", "str"), f.get("n", "int", 1), f.get("stream", "bool", False)
    f.get("user", "str")
    if not 1 <= n <= limits.max_n:
        raise bad_request(f"n must be between 1 and {limits.max_n}, got {n}", "n")
    options = f.get("stream_options", "object")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = _Fields(options or {}).get("include_usage", "bool", False)
    return model, n, stream, include_usage


def _max_tokens_cap(n: int, num_prompts: int, max_tokens: int | None, param: str, limits: RequestLimits) -> int:
    """The most output tokens one choice may take; APIError(400) when n x max_tokens, over every prompt,
    is above `limits.max_total_tokens`."""
    choices, limit = n * num_prompts, limits.max_total_tokens
    wanted = choices * (max_tokens or 1)
    if wanted > limit:
        prompts = f" x {num_prompts} prompts" if num_prompts > 1 else ""
        raise bad_request(f"n x max_tokens is {n}{prompts} x {max_tokens or 1} = {wanted} tokens, over this "
                          f"server's limit of {limit} output tokens per request", param if max_tokens else "n")
    return limit // choices


def _priority(f: _Fields, limits: RequestLimits) -> int:
    priority = f.get("priority", "int", 0)
    return priority if limits.allow_client_priority else 0


def _cache_salt(f: _Fields) -> str | None:
    salt = f.get("cache_salt", "str")
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                          f"got {len(salt)}", "cache_salt")
    return salt


def _sampling(f: _Fields, logprobs: int | None) -> dict[str, Any]:
    sampling = {name: value for name, kind in _SAMPLING_FIELDS if (value := f.get(name, kind)) is not None}
    if bias := logit_bias(f.body.get("logit_bias")):
        sampling["logit_bias"] = bias
    stop = f.body.get("stop")
    if stop is not None:
        sampling["stop"] = _stop_strings(stop)
    stop_ids = f.get("stop_token_ids", "list")
    if stop_ids is not None:
        if not all(_KINDS["int"][1](t) and 0 <= t <= INT64_MAX for t in stop_ids):
            raise bad_request("stop_token_ids must be an array of non-negative 64-bit integers", "stop_token_ids")
        sampling["stop_token_ids"] = tuple(stop_ids)
    sampling["logprobs"] = logprobs
    return sampling


def _stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    longest = max(len(s) for s in stops) if stops else 0
    if longest > MAX_STOP_CHARS:
        raise bad_request(f"each stop string may be at most {MAX_STOP_CHARS} characters, got {longest}", "stop")
    return tuple(stops)


def _prompt_logprobs(f: _Fields) -> int | None:
    """vLLM's prompt_logprobs: 0 the prompt tokens' own logprobs, N those and the top N at each position."""
    value = f.get("prompt_logprobs", "int")
    _check_logprobs(value, "prompt_logprobs")
    return value


def _check_logprobs(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= SamplingParams.MAX_LOGPROBS:
        raise bad_request(f"{name} must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {value}", name)
