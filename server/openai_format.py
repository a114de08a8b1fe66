"""OpenAI wire objects: chat and text completion responses, stream chunks, logprobs, usage."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.core.messages import FinishReason, TokenEvent, TokenLogprob
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.server.prompt_logprobs import ScoredPrompt, legacy_prompt_logprobs, top_by_text, vllm_prompt_logprobs
from pdserve.server.reasoning import ReasoningParser, ReasoningSplitter
from pdserve.server.tool_call_stream import ToolCallStream
from pdserve.server.tool_calls import ToolCall, Tools, forced_calls, parse_auto


@dataclass(frozen=True, slots=True)
class Delta:
    """What one TokenEvent adds to a choice: the text to send, its tokens' logprobs (and with the first token,
    the prompt's when asked)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    offsets: tuple[int, ...] = ()          # character offset of each logprob's token in the choice's text
    prompt: ScoredPrompt | None = None


@dataclass(slots=True, eq=False)
class Choice:
    """What one engine request (one choice) has produced so far."""

    index: int
    num_prompt_tokens: int
    echo: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    scores_only: bool = False              # max_tokens 0: the one token the engine samples is not returned
    prompt: ScoredPrompt | None = None
    text: list[str] = field(default_factory=list)
    text_len: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0             # prompt tokens whose KV came from the prefix cache
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.text_len = len(self.echo)

    @property
    def full_text(self) -> str:
        return self.echo + "".join(self.text)

    def add(self, event: TokenEvent, token_text: "TokenText") -> Delta:
        """Record `event`'s text, logprobs and counts; the returned delta carries the echo first."""
        if self.scores_only:
            event = _unsampled(event)
        if event.prompt_logprobs is not None:
            self.prompt = ScoredPrompt(self.prompt_token_ids, event.prompt_logprobs)
        offsets, offset = [], self.text_len
        for entry in event.logprobs:
            offsets.append(offset)
            offset += len(token_text(entry.token_id))
        self.text.append(event.text)
        self.text_len += len(event.text)
        self.logprobs += event.logprobs
        self.offsets += offsets
        self.num_output_tokens = max(self.num_output_tokens, event.num_output_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason.value, event.error
        prefix = self.echo if len(self.text) == 1 else ""
        return Delta(prefix + event.text, event.logprobs, tuple(offsets),
                     self.prompt if event.prompt_logprobs is not None else None)


def _unsampled(event: TokenEvent) -> TokenEvent:
    """`event` less its token (a scores-only choice): it ends at max_tokens 0, whatever the token was."""
    reason = event.finish_reason
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        reason = FinishReason.LENGTH
    return event._replace(token_ids=(), text="", logprobs=(), finish_reason=reason, num_output_tokens=0)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A chat request's --reasoning-parser split: whether its output starts inside the reasoning (the prompt
    did not close it), and whether to send the reasoning (the request's include_reasoning)."""

    at_start: bool
    include: bool = True


class TokenText:
    """The text of single tokens, cached (logprob entries name each token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def offsets(self, token_ids: Sequence[int]) -> list[int]:
        """Where each token's text starts in the text of `token_ids` decoded together (as an echo is; a token
        that completes no character yet: where that character starts)."""
        detokenizer, offsets, end = IncrementalDetokenizer(self._tokenizer), [], 0
        for token_id in token_ids:
            offsets.append(end)
            end += len(detokenizer.push(token_id))
        return offsets


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's `usage` object, `prompt_tokens_details.cached_tokens` included (0 without a cache hit)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ChatFormat:
    """`chat.completion` and `chat.completion.chunk` objects; with `tools` (not `none`), the output's tool
    calls as `tool_calls` (streamed as `ToolCallStream` says) and `finish_reason: "tool_calls"`."""

    def __init__(self, request_id: str, model: str, created: int, token_text: TokenText,
                 tools: Tools | None = None, parser: str = "hermes", reasoning: Reasoning | None = None,
                 prompt_logprobs: int | None = None) -> None:
        """`prompt_logprobs` (vLLM's): the response's top-level `prompt_logprobs`, with that many alternatives."""
        self.head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": None}
        self.token_text = token_text
        self.prompt_logprobs = prompt_logprobs
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.parser = parser
        self.reasoning = reasoning
        self._streams: dict[int, ToolCallStream] = {}
        self._splitters: dict[int, ReasoningSplitter] = {}

    def first_chunk(self, index: int) -> dict | None:
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def chunk(self, index: int, delta: Delta, with_logprobs: bool, finish_reason: str | None) -> dict:
        reasoning, text = self._split_delta(index, delta.text, finish_reason is not None)
        calls = []
        if self.tools is not None:
            stream = self._streams.setdefault(index, ToolCallStream(self.tools, self.parser))
            text, calls = stream.feed(delta.text)
            if finish_reason is not None:
                rest, more = stream.finish()
                text, calls = text + rest, calls + more
                finish_reason = "tool_calls" if stream.sent and finish_reason == "stop" else finish_reason
        message = {"content": text} if text or (finish_reason is None and not reasoning) else {}
        if reasoning:
            message.update(self._reasoning_fields(reasoning))
        if calls:
            message["tool_calls"] = calls
        chunk = self._chunk(index, message, self.logprobs(delta.logprobs) if with_logprobs else None, finish_reason)
        if delta.prompt is not None and self.prompt_logprobs is not None:
            chunk["prompt_logprobs"] = vllm_prompt_logprobs(delta.prompt, self.prompt_logprobs, self.token_text)
        return chunk

    def _split_delta(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) of one piece of a choice's output ("" reasoning without a reasoning parser)."""
        if self.reasoning is None:
            return "", text
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.reasoning.at_start))
        reasoning, content = splitter.feed(text)
        if last:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning if self.reasoning.include else "", content

    def _reasoning_fields(self, reasoning: str | None) -> dict:
        """vLLM's reasoning_content, and its newer name reasoning; nothing without a reasoning parser."""
        if self.reasoning is None:
            return {}
        reasoning = reasoning if self.reasoning.include else None
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def _chunk(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish_reason}]}

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self.head, "choices": [], "usage": usage_}

    def response(self, choices: Sequence[Choice], usage_: dict, with_logprobs: bool) -> dict:
        body = {**self.head, "object": "chat.completion",
                "choices": [{"index": c.index, **self._message(c),
                             "logprobs": self.logprobs(c.logprobs) if with_logprobs else None} for c in choices],
                "usage": usage_}
        if self.prompt_logprobs is not None:         # NOTE: vLLM's place: one prompt, whatever n is
            prompt = choices[0].prompt if choices else None
            body["prompt_logprobs"] = prompt and vllm_prompt_logprobs(prompt, self.prompt_logprobs, self.token_text)
        return body

    def _message(self, choice: Choice) -> dict:
        reasoning, content = None, choice.full_text
        if self.reasoning is not None:
            reasoning, content = ReasoningParser.split(content, self.reasoning.at_start)
        calls = self._calls(content or "")
        message = {"role": "assistant", "content": content, "refusal": None, **self._reasoning_fields(reasoning)}
        if not calls:
            return {"message": message, "finish_reason": choice.finish_reason}
        if self.tools.forced:
            content = None
        else:
            content = parse_auto(content or "", self.parser, self.tools.names)[0] or None
        reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        return {"message": {**message, "content": content, "tool_calls": [call.body() for call in calls]},
                "finish_reason": reason}

    def _calls(self, text: str) -> list[ToolCall]:
        if self.tools is None:
            return []
        if self.tools.forced:
            return forced_calls(text) or []
        return parse_auto(text, self.parser, self.tools.names)[1]

    def logprobs(self, entries: Sequence[TokenLogprob]) -> dict:
        return {"content": [{**self._token(e.token_id, e.logprob),
                             "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries],
                "refusal": None}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionFormat:
    """`text_completion` objects, streamed or whole."""

    def __init__(self, request_id: str, model: str, created: int, token_text: TokenText,
                 echo_logprobs: int | None = None, prompt_logprobs: int | None = None) -> None:
        """`echo_logprobs`: the echoed prompt's tokens lead `logprobs`, with that many alternatives each;
        `prompt_logprobs` (vLLM's): each choice's `prompt_logprobs`, with that many alternatives."""
        self.head = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                     "system_fingerprint": None}
        self.token_text = token_text
        self.echo_logprobs, self.prompt_logprobs = echo_logprobs, prompt_logprobs

    def first_chunk(self, index: int) -> dict | None:
        return None

    def chunk(self, index: int, delta: Delta, with_logprobs: bool, finish_reason: str | None) -> dict:
        logprobs = self._logprobs(delta.logprobs, delta.offsets, delta.prompt) if with_logprobs else None
        choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish_reason}
        if delta.prompt is not None:
            self._add_prompt_logprobs(choice, delta.prompt)
        return {**self.head, "choices": [choice]}

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self.head, "choices": [], "usage": usage_}

    def response(self, choices: Sequence[Choice], usage_: dict, with_logprobs: bool) -> dict:
        return {**self.head, "choices": [self._choice(c, with_logprobs) for c in choices], "usage": usage_}

    def _choice(self, c: Choice, with_logprobs: bool) -> dict:
        logprobs = self._logprobs(c.logprobs, c.offsets, c.prompt) if with_logprobs else None
        choice = {"index": c.index, "text": c.full_text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        self._add_prompt_logprobs(choice, c.prompt)
        return choice

    def _add_prompt_logprobs(self, choice: dict, prompt: ScoredPrompt | None) -> None:
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt and vllm_prompt_logprobs(prompt, self.prompt_logprobs, self.token_text)

    def _logprobs(self, entries: Sequence[TokenLogprob], offsets: Sequence[int], prompt: ScoredPrompt | None) -> dict:
        """The output's logprobs, led by the echoed prompt's when it is echoed with them (and has arrived)."""
        output = self.logprobs(entries, offsets)
        if self.echo_logprobs is None or prompt is None:
            return output
        scored = legacy_prompt_logprobs(prompt, self.echo_logprobs, self.token_text)
        return {key: scored[key] + output[key] for key in output}

    def logprobs(self, entries: Sequence[TokenLogprob], offsets: Sequence[int]) -> dict:
        """`{tokens, token_logprobs, top_logprobs, text_offset}`."""
        return {"tokens": [self.token_text(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [top_by_text(self.token_text, e.token_id, e.logprob, e.top) for e in entries],
                "text_offset": list(offsets)}
