"""Streaming client for OpenAI-compatible servers: an incremental SSE parser and
one timed request.

A request is a success only when its stream ends with `data: [DONE]` (or, for
servers that never send it, `require_done=False`, a chunk with a finish_reason
followed by a clean end of stream), carried at least one content chunk, and
saw no error event. HTTP errors, resets, timeouts and truncated streams are
failures with the reason recorded.
"""
from __future__ import annotations

import codecs
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import SampleRequest

_LINE_END = re.compile(r"\r\n|\r|\n")
LENGTH_CONTROLS = ("vllm", "generation-config", "max-tokens")


class SSEParser:
    """Incremental Server-Sent Events parser (WHATWG rules, data field only).

    Feed it byte chunks split anywhere; it returns the data of each complete
    event (multi-line data joined by "\\n"). Comments, `event:`, `id:` and
    `retry:` fields are skipped; lines may end in "\\r\\n", "\\r" or "\\n".
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self._data: list[str] = []
        self._skip_lf = False
        self._at_start = True

    @property
    def has_pending(self) -> bool:
        """True when an event has begun but not been terminated by a blank line."""
        return bool(self._partial or self._data)

    def feed(self, chunk: bytes) -> list[str]:
        text = self._decoder.decode(chunk)
        if not text:
            return []
        if self._skip_lf:
            text = text.removeprefix("\n")
            self._skip_lf = False
        if self._at_start:
            text = text.removeprefix("\ufeff")
            self._at_start = False
        return self._consume(self._partial + text)

    def _consume(self, buffer: str) -> list[str]:
        events: list[str] = []
        start = 0
        for match in _LINE_END.finditer(buffer):
            self._line(buffer[start : match.start()], events)
            start = match.end()
        self._partial = buffer[start:]
        self._skip_lf = buffer.endswith("\r") and not self._partial
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
            self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """Where and how to send requests.

    `length_control` says how to pin the output length: "vllm" sends
    max_tokens + min_tokens + ignore_eos; "generation-config" sends
    transformers serve's `generation_config` JSON (max/min_new_tokens, no EOS,
    sampling only with a positive temperature);
    "max-tokens" sends max_tokens only.
    """

    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    length_control: str = "vllm"
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    require_done: bool = True
    request_timeout: float = 300.0

    @property
    def root(self) -> str:
        """The server's root URL (`base_url` without a trailing /v1)."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.root}/v1/{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(endpoint: EndpointConfig, sample: SampleRequest) -> dict[str, Any]:
    """The JSON body of a streaming request for `sample`."""
    payload: dict[str, Any] = {
        "model": endpoint.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": sample.output_len,
    }
    if endpoint.endpoint == "chat":
        payload["messages"] = list(sample.messages) or [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    if endpoint.temperature is not None:
        payload["temperature"] = endpoint.temperature
    if endpoint.length_control == "vllm":
        payload |= {"min_tokens": sample.output_len, "ignore_eos": True}
    elif endpoint.length_control == "generation-config":
        config = {"max_new_tokens": sample.output_len, "min_new_tokens": sample.output_len,
                  "do_sample": bool(endpoint.temperature)}
        payload["generation_config"] = json.dumps(config)
    return payload | endpoint.extra_body


class StreamError(Exception):
    """The server reported an error inside the stream, or sent something unreadable."""


@dataclass(slots=True)
class _Stream:
    """What has been seen so far on one response stream."""

    start: float
    endpoint: str
    first_token: float | None = None
    last_token: float = 0.0
    end: float = 0.0
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    done: bool = False
    text: list[str] = field(default_factory=list)

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done, self.end = True, now
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as error:
            raise StreamError(f"unreadable event {data[:80]!r}: {error}") from None
        if not isinstance(event, dict):
            raise StreamError(f"unexpected event {data[:80]!r}")
        if event.get("error"):
            raise StreamError(f"error event: {_error_message(event['error'])}")
        if event.get("object") == "error":
            raise StreamError(f"error event: {_error_message(event)}")
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            self._on_choice(choice, now)

    def _on_choice(self, choice: dict, now: float) -> None:
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        text = self._token_text(choice)
        if text is None:
            return
        self.text.append(text)
        if self.first_token is None:
            self.first_token = now
        else:
            self.itl.append(now - self.last_token)
        self.last_token = now

    def _token_text(self, choice: dict) -> str | None:
        """The text of the token a chunk carries ("" for one that completes no character yet, which vLLM and
        pdserve stream too), or None for a chunk that carries no token (a role announcement, a bare finish)."""
        if self.endpoint == "chat":
            delta = choice.get("delta") or {}
            empty = "" if delta.get("content") == "" and "role" not in delta else None
            text = delta.get("content") or delta.get("reasoning_content") or empty
        else:
            text = choice.get("text")
        return None if text == "" and choice.get("finish_reason") else text


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _stream_failure(stream: _Stream, parser: SSEParser, require_done: bool) -> str:
    """Why a stream that reached its end is not a success ("" when it is one)."""
    if not stream.done and (require_done or stream.finish_reason is None):
        cut = " (incomplete event at the end)" if parser.has_pending else ""
        return f"stream ended without [DONE]{cut}"
    if stream.first_token is None:
        return "stream carried no content"
    return ""


async def _read_stream(response: aiohttp.ClientResponse, stream: _Stream, parser: SSEParser) -> None:
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        for data in parser.feed(chunk):
            stream.on_event(data, now)
            if stream.done:
                return
    stream.end = time.perf_counter()


async def send_request(
    session: aiohttp.ClientSession,
    endpoint: EndpointConfig,
    sample: SampleRequest,
    index: int,
    origin: float,
) -> RequestRecord:
    """Send one streaming request and time it; never raises for server or network faults.

    `origin` is the benchmark's start on the `time.perf_counter` clock.
    """
    record, _ = await send_request_with_text(session, endpoint, sample, index, origin)
    return record


async def send_request_with_text(
    session: aiohttp.ClientSession,
    endpoint: EndpointConfig,
    sample: SampleRequest,
    index: int,
    origin: float,
) -> tuple[RequestRecord, str]:
    """`send_request`, and the text the stream carried (a chat turn's answer, for the next turn)."""
    stream = _Stream(start=time.perf_counter(), endpoint=endpoint.endpoint)
    parser = SSEParser()
    timeout = aiohttp.ClientTimeout(total=endpoint.request_timeout)
    payload = build_payload(endpoint, sample)
    try:
        async with session.post(endpoint.url, json=payload, headers=endpoint.headers, timeout=timeout) as response:
            if response.status != 200:
                body = await response.text(errors="replace")
                error = f"HTTP {response.status}: {body[:200].strip()}"
            else:
                await _read_stream(response, stream, parser)
                error = _stream_failure(stream, parser, endpoint.require_done)
    except StreamError as e:
        error = str(e)
    except TimeoutError:
        error = f"timeout after {endpoint.request_timeout:g} s"
    except (aiohttp.ClientError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    return _record(index, sample, stream, origin, error), "".join(stream.text)


def _record(index: int, sample: SampleRequest, stream: _Stream, origin: float, error: str) -> RequestRecord:
    usage = stream.usage or {}
    first = stream.first_token
    return RequestRecord(
        index=index,
        kind=sample.kind,
        prompt_len=sample.prompt_len,
        max_tokens=sample.output_len,
        send_time=stream.start - origin,
        success=not error,
        error=error,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or (len(stream.itl) + (first is not None))),
        ttft=first - stream.start if first is not None else 0.0,
        latency=(stream.end or time.perf_counter()) - stream.start,
        itl=tuple(stream.itl),
        finish_reason=stream.finish_reason,
        usage_reported=stream.usage is not None,
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        conversation=sample.conversation,
        turn=sample.turn,
    )
