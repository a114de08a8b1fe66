"""The engine requests behind one HTTP request: submit, stream or collect, and always clean up."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, suppress

import orjson
from aiohttp import web

from pdserve.engine.core.messages import FinishReason, Request, TokenEvent
from pdserve.engine.engine import EngineOverloaded, EngineStopped, RequestStream
from pdserve.server.errors import APIError, from_value_error
from pdserve.server.openai_format import ChatFormat, Choice, CompletionFormat, usage
from pdserve.server.protocol import ParsedRequest
from pdserve.server.sse import SSEWriter
from pdserve.server.state import AccessRecord, ServerState

logger = logging.getLogger(__name__)


class Generation:
    """One HTTP request's choices. Use `submit()`, then `stream()` or `collect()`, and always `close()`."""

    def __init__(self, state: ServerState, parsed: ParsedRequest, prompts: Sequence[tuple[int, ...]],
                 echoes: Sequence[str], fmt: ChatFormat | CompletionFormat, request_id: str,
                 access: AccessRecord) -> None:
        self.state, self.parsed, self.fmt = state, parsed, fmt
        self.engine = state.running_engine()
        self.metrics = state.metrics
        self.access = access
        self.start = time.monotonic()
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.choices: list[Choice] = []
        self.streams: list[RequestStream] = []
        self.requests = self._requests(prompts, echoes, request_id)
        access.request_id, access.prompt_tokens = request_id, self.prompt_tokens

    def _requests(self, prompts: Sequence[tuple[int, ...]], echoes: Sequence[str], request_id: str) -> list[Request]:
        n, requests = self.parsed.n, []
        single = n * len(prompts) == 1
        for p, ids in enumerate(prompts):
            try:
                params = self.parsed.sampling_params(len(ids), self.engine.max_model_len)
            except ValueError as e:
                raise from_value_error(e) from None
            for j in range(n):
                index = p * n + j
                self.choices.append(Choice(index, len(ids), echoes[p], ids, self.parsed.scores_only))
                requests.append(Request(request_id if single else f"{request_id}-{index}", ids, params.for_choice(j),
                                        self.parsed.priority, cache_salt=self.parsed.cache_salt))
        return requests

    def submit(self) -> None:
        """Queue every choice's request; on failure none stays queued. Raises APIError 400/429/503."""
        try:
            for request in self.requests:
                self.streams.append(self.engine.submit(request))
        except ValueError as e:
            self.abort()
            raise from_value_error(e, self.parsed.prompt_param) from None
        except EngineOverloaded as e:
            self.abort()
            raise APIError(429, f"the server is overloaded: {e}", code="rate_limit_exceeded",
                           retry_after=self.state.config.retry_after) from None
        except EngineStopped as e:
            self.abort()
            raise APIError(503, str(e), retry_after=self.state.config.retry_after) from None
        self.state.add(self)

    def abort(self) -> None:
        for stream in self.streams:
            self.engine.abort(stream.request_id)

    async def close(self) -> None:
        """Abort what is unfinished (a client that left, an error), record metrics, forget this generation."""
        for stream in self.streams:
            await stream.aclose()
        now = time.monotonic()
        for choice in self.choices[:len(self.streams)]:
            if choice.finish_reason is None:
                choice.finish_reason = FinishReason.ABORT.value
                self._observe_finished(choice, now)
        self.access.output_tokens = sum(c.num_output_tokens for c in self.choices)
        self.access.finish_reasons = ",".join(c.finish_reason or "-" for c in self.choices)
        self.metrics.drain_transfer_times()
        self.state.discard(self)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        sse = SSEWriter(request)
        try:
            await sse.prepare()
            await self._write_events(sse)
        except ConnectionResetError:               # the client left; close() aborts what is unfinished
            return sse.response
        except Exception:
            logger.exception("stream %s failed", self.access.request_id)
            with suppress(ConnectionResetError):
                await sse.send(APIError(500, "internal server error", code="internal_error").body())
                await sse.done()
        return sse.response

    async def _write_events(self, sse: SSEWriter) -> None:
        for choice in self.choices:
            if (first := self.fmt.first_chunk(choice.index)) is not None:
                await sse.send(self._with_usage_field(first))
        async with aclosing(merge(self.streams)) as events:
            async for index, event in events:
                chunk = self._on_event(index, event)
                if event.finish_reason is FinishReason.ERROR:
                    await sse.send(self._engine_error(event).body())
                    await sse.done()
                    return
                if chunk is not None:
                    await sse.send(self._with_usage_field(chunk))
        if self.parsed.include_usage:
            await sse.send(self.fmt.usage_chunk(self.usage()))
        await sse.done()

    async def collect(self) -> web.Response:
        async with aclosing(merge(self.streams)) as events:
            async for index, event in events:
                self._on_event(index, event)
                if event.finish_reason is FinishReason.ERROR:
                    raise self._engine_error(event)
        body = self.fmt.response(self.choices, self.usage(), self.with_logprobs)
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    @property
    def with_logprobs(self) -> bool:
        return self.parsed.sampling.get("logprobs") is not None

    def usage(self) -> dict:
        completion = sum(c.num_output_tokens for c in self.choices)
        return usage(self.prompt_tokens, completion, self._cached_tokens())

    def _cached_tokens(self) -> int:
        """Per prompt (counted once, as prompt_tokens is), the fewest cached tokens any of its n choices had."""
        n = self.parsed.n
        return sum(min(c.num_cached_tokens for c in self.choices[p:p + n]) for p in range(0, len(self.choices), n))

    def _on_event(self, index: int, event: TokenEvent) -> dict | None:
        """Update the choice and metrics; the chunk to stream, or None when there is nothing to send.

        Every event that carries a token is sent, as vLLM's stream does, even when the token completes no
        character yet (its text is then empty): a client timing tokens sees each step, not two at once."""
        choice, now = self.choices[index], time.monotonic()
        if event.token_ids:
            self._observe_token(choice, now)
        delta = choice.add(event, self.fmt.token_text)
        if event.finished:
            self._observe_finished(choice, now)
        if event.finish_reason is FinishReason.ERROR or not (delta.text or event.token_ids or event.finished):
            return None
        return self.fmt.chunk(index, delta, self.with_logprobs, choice.finish_reason)

    def _observe_token(self, choice: Choice, now: float) -> None:
        if choice.first_token_at is None:
            choice.first_token_at = now
            self.metrics.observe_ttft(now - self.start)
            if self.access.ttft is None:
                self.access.ttft = now - self.start
        else:
            self.metrics.observe_itl(now - choice.last_token_at)
        choice.last_token_at = now

    def _observe_finished(self, choice: Choice, now: float) -> None:
        ttft, mean_itl = self._latencies(choice)
        self.metrics.observe_finished(choice.finish_reason, choice.num_prompt_tokens, choice.num_output_tokens,
                                      now - self.start, mean_itl)
        if self.engine.slos is not None:
            self.metrics.observe_slos(self.engine.slos, choice.finish_reason, choice.num_prompt_tokens, ttft,
                                      mean_itl)

    def _latencies(self, choice: Choice) -> tuple[float | None, float | None]:
        """(TTFT, mean inter-token latency) of a finished choice; None where it has no such interval."""
        if choice.first_token_at is None:
            return None, None
        ttft, gaps = choice.first_token_at - self.start, choice.num_output_tokens - 1
        return ttft, (choice.last_token_at - choice.first_token_at) / gaps if gaps > 0 else None

    def _with_usage_field(self, chunk: dict) -> dict:
        return {**chunk, "usage": None} if self.parsed.include_usage else chunk

    @staticmethod
    def _engine_error(event: TokenEvent) -> APIError:
        return APIError(500, f"generation failed: {event.error or 'unknown engine error'}", code="engine_error")


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of several streams as they come, each tagged with its stream's index."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                event = task.result()
                if not event.finished:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, event
    finally:
        for task in pending:
            task.cancel()
