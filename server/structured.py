"""Structured outputs of a request: OpenAI's `response_format`, vLLM's `structured_outputs` (and its older
`guided_*` fields), tools forced by `tool_choice`, and `logit_bias`. Parsed into a spec here; compiled to an
llguidance grammar off the event loop, checked against the model's tokenizer and cached by spec."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from llguidance import LLTokenizer
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pdserve.engine.text.grammar import choice_grammar, grammar_error, json_schema_grammar, lark_grammar, regex_grammar
from pdserve.server.errors import bad_request

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_UNSUPPORTED_STRUCTURED = ("json_object", "structural_tag", "whitespace_pattern", "disable_any_whitespace",
                           "disable_additional_properties", "disable_fallback")
MAX_LOGIT_BIAS = 300


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What the output must match: `kind` json | regex | choice | grammar, its value as compact JSON
    text (the cache key), and the request field it came from (errors name it)."""

    kind: str
    spec: str
    param: str


def output_format(body: dict) -> OutputFormat | None:
    """The one output constraint a request asks for, or None; APIError(400) naming the field otherwise."""
    found = [f for f in (_response_format(body.get("response_format")), _structured_outputs(body)) if f]
    if len(found) > 1:
        raise bad_request("response_format and structured_outputs (or guided_*) cannot be combined",
                          found[1].param)
    return found[0] if found else None


def _response_format(value: Any) -> OutputFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                          "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return OutputFormat("json", _canonical({"type": "object"}), "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema must be an object with a string `name`",
                          "response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_request("response_format.json_schema.schema must be an object (and strict a boolean)",
                          "response_format.json_schema.schema")
    return OutputFormat("json", _canonical(schema), "response_format.json_schema.schema")


def _structured_outputs(body: dict) -> OutputFormat | None:
    wanted: list[tuple[str, Any, str]] = []
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        for name in _UNSUPPORTED_STRUCTURED:
            if options.get(name) not in (None, False):
                raise bad_request(f"structured_outputs.{name} is not supported by this server",
                                  f"structured_outputs.{name}")
        unknown = set(options) - set(STRUCTURED_KINDS) - set(_UNSUPPORTED_STRUCTURED)
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {sorted(unknown)}", "structured_outputs")
        wanted += [(k, options[k], f"structured_outputs.{k}") for k in STRUCTURED_KINDS if options.get(k) is not None]
    wanted += [(kind, body[name], name) for name, kind in _GUIDED.items() if body.get(name) is not None]
    if len(wanted) > 1:
        raise bad_request("ask for one of json, regex, choice or grammar", wanted[1][2])
    if not wanted:
        return None
    kind, value, param = wanted[0]
    return OutputFormat(kind, _checked(kind, value, param), param)


def _checked(kind: str, value: Any, param: str) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as e:
                raise bad_request(f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema (an object)", param)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty array of non-empty strings", param)
    elif not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return _canonical(value)


def _canonical(value: Any) -> str:
    """Compact JSON text, keys in the request's order (a schema's property order is the output's order)."""
    return orjson.dumps(value).decode()


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({"token id": bias in [-100, 100]}, at most 300) as sorted pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 18):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {key}",
                              "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def build_grammar(fmt: OutputFormat) -> str:
    """The llguidance grammar text of `fmt` (not yet checked against a tokenizer)."""
    value = orjson.loads(fmt.spec)
    if fmt.kind == "json":
        return json_schema_grammar(value)
    if fmt.kind == "regex":
        return regex_grammar(value)
    if fmt.kind == "choice":
        return choice_grammar(value)
    return lark_grammar(any_to_lark(value))        # Lark as is; GBNF / EBNF (`root ::= ...`) converted


class GrammarCompiler:
    """Grammars by spec, compiled and checked in a worker thread, kept in an LRU (errors too)."""

    def __init__(self, tokenizer_source: Callable[[], LLTokenizer], observe_seconds: Callable[[float], None],
                 capacity: int = 512) -> None:
        self._tokenizer_source = tokenizer_source          # built once (slow), in the first compile's thread
        self._observe_seconds = observe_seconds
        self._cache: OrderedDict[tuple[str, str], tuple[str | None, str | None]] = OrderedDict()
        self.capacity = capacity

    async def grammar(self, fmt: OutputFormat) -> str:
        """The checked grammar of `fmt`; APIError(400) naming `fmt.param` when it is invalid."""
        key = (fmt.kind, fmt.spec)
        entry = self._cache.get(key)
        if entry is None:
            entry = await asyncio.to_thread(self._compile, fmt)
            self._cache[key] = entry
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        grammar, error = entry
        if error is not None:
            raise bad_request(f"invalid {fmt.param}: {error}", fmt.param, code="invalid_grammar")
        return grammar

    def _compile(self, fmt: OutputFormat) -> tuple[str | None, str | None]:
        started = time.perf_counter()
        try:
            grammar = build_grammar(fmt)
        except (ValueError, TypeError, RuntimeError, GbnfToLarkError) as e:
            return None, str(e)
        error = grammar_error(grammar, self._tokenizer_source())
        self._observe_seconds(time.perf_counter() - started)
        return (None, error) if error else (grammar, None)
