"""Each request's stream of TokenEvents: the actors' step outputs, detokenized and cut at stop strings."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.engine.core.messages import FinishReason, PromptLogprobs, Request, StepOutput, TokenEvent, TokenLogprob
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.stop_strings import StopStringMatcher
from pdserve.engine.text.tokenizer import Tokenizer


class NoText:
    """The detokenizer of a model without a tokenizer (a simulated one): token ids, no text."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass(slots=True, eq=False)
class Stream:
    request: Request
    detokenizer: IncrementalDetokenizer | NoText
    stops: StopStringMatcher | None           # None: no stop strings
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None    # to go out with the first token
    plain: bool = True                        # no stop strings and nothing to attach: on_step's short path

    def end(self, reason: FinishReason, error: str | None = None) -> None:
        """Put the stream's last event: no token, `reason` (and `error`)."""
        self.queue.put_nowait(TokenEvent(self.request.request_id, finish_reason=reason, error=error,
                                         num_prompt_tokens=self.num_prompt_tokens,
                                         num_cached_tokens=self.num_cached_tokens,
                                         num_output_tokens=self.num_output_tokens))


class RequestStream:
    """Async iterator of TokenEvent for one request; the last event has `finish_reason` set.

    Leaving the iteration early (break, cancellation, `aclose()`) aborts the request.
    """

    def __init__(self, stream: Stream, abort: Callable[[str], None]) -> None:
        self._stream, self._abort = stream, abort
        self._finished = False
        self.request_id = stream.request.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._finished:
            raise StopAsyncIteration
        try:
            event = await self._stream.queue.get()
        except BaseException:
            await self.aclose()
            raise
        self._finished = event.finished
        return event

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)


class Streams:
    """The open streams; `stop_in_actors(id)` aborts a request the actors still hold, `left(id)` says one that
    ended there left the coordinator's table."""

    def __init__(self, tokenizer: Tokenizer | None, stop_in_actors: Callable[[str], None],
                 left: Callable[[str], None]) -> None:
        self.tokenizer, self.stop_in_actors, self.left = tokenizer, stop_in_actors, left
        self.open: dict[str, Stream] = {}

    def __len__(self) -> int:
        return len(self.open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.open

    def add(self, request: Request, abort: Callable[[str], None]) -> RequestStream:
        params = request.params
        detokenizer = NoText() if self.tokenizer is None else \
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        stops = StopStringMatcher(params.stop) if params.stop else None
        stream = Stream(request, detokenizer, stops, num_prompt_tokens=len(request.prompt_token_ids),
                        plain=stops is None)
        self.open[request.request_id] = stream
        return RequestStream(stream, abort)

    def end(self, request_id: str, reason: FinishReason, error: str | None = None) -> bool:
        """End an open stream with `reason`; False when it was not open."""
        stream = self.open.pop(request_id, None)
        if stream is not None:
            stream.end(reason, error)
        return stream is not None

    def end_all(self, request_ids: Iterable[str], reason: FinishReason, error: str | None = None) -> int:
        """End every open stream of `request_ids`; how many were open."""
        return sum(self.end(request_id, reason, error) for request_id in list(request_ids))

    def on_step(self, output: StepOutput) -> None:
        """One actor step's tokens: detokenize each and put its event on its request's stream."""
        streams = self.open
        logprobs = output.logprobs or (None,) * len(output)
        if output.cached_tokens is not None:
            self._note_cached(output)
        if output.prompt_logprobs is not None:
            self._note_prompt_logprobs(output)
        for request_id, token_id, reason, logprob in zip(output.request_ids, output.token_ids,
                                                         output.finish_reasons, logprobs):
            stream = streams.get(request_id)
            if stream is None:                     # aborted or stopped while in flight between actors
                if reason is None:
                    self.stop_in_actors(request_id)
            elif reason is None and stream.plain:     # the common case, kept short: mid-stream
                stream.num_output_tokens += 1
                stream.queue.put_nowait(TokenEvent(request_id, (token_id,), stream.detokenizer.push(token_id),
                                                   (logprob,) if logprob else (), None, None,
                                                   stream.num_prompt_tokens, stream.num_output_tokens,
                                                   stream.num_cached_tokens))
            elif reason is FinishReason.ERROR:
                self.end(request_id, FinishReason.ERROR, output.error)
                self.left(request_id)
            else:
                self._deliver(stream, token_id, logprob, reason)

    def _note_cached(self, output: StepOutput) -> None:
        """A request's first token carries how much of its prompt came from the prefix cache."""
        for request_id, cached in zip(output.request_ids, output.cached_tokens):
            stream = self.open.get(request_id)
            if stream is not None and stream.num_output_tokens == 0:
                stream.num_cached_tokens = cached

    def _note_prompt_logprobs(self, output: StepOutput) -> None:
        for request_id, scored in zip(output.request_ids, output.prompt_logprobs):
            stream = self.open.get(request_id)
            if scored is not None and stream is not None and stream.num_output_tokens == 0:
                stream.prompt_logprobs, stream.plain = scored, False

    def _deliver(self, stream: Stream, token_id: int, logprob: TokenLogprob | None,
                 actor_reason: FinishReason | None) -> None:
        stream.num_output_tokens += 1
        text = "" if actor_reason is FinishReason.STOP else stream.detokenizer.push(token_id)
        stopped, reason = False, actor_reason
        if stream.stops is not None:
            text, stopped = stream.stops.feed(text)
        if stopped:
            reason = FinishReason.STOP
        elif reason is not None:
            text, reason = _final_text(stream, text, reason)
        request_id = stream.request.request_id
        scored, stream.prompt_logprobs, stream.plain = stream.prompt_logprobs, None, stream.stops is None
        stream.queue.put_nowait(TokenEvent(request_id, (token_id,), text, (logprob,) if logprob else (), reason,
                                           None, stream.num_prompt_tokens, stream.num_output_tokens,
                                           stream.num_cached_tokens, scored))
        if reason is not None:
            del self.open[request_id]
            if actor_reason is None:               # a stop string: the actors still hold the sequence
                self.stop_in_actors(request_id)
            else:
                self.left(request_id)


def _final_text(stream: Stream, text: str, reason: FinishReason) -> tuple[str, FinishReason]:
    """The text held back by the detokenizer and the stop strings, at the end of a stream."""
    tail = stream.detokenizer.flush()
    if stream.stops is None:
        return text + tail, reason
    tail, stopped = stream.stops.feed(tail)
    return text + (tail if stopped else tail + stream.stops.flush()), FinishReason.STOP if stopped else reason
