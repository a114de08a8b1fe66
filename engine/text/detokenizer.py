"""Streaming text: incremental detokenization and stop-string matching."""
from __future__ import annotations

from collections.abc import Sequence

from engine.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the output (leading-space rules of some decoders)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, one token at a time.

    Decodes only a small window, vLLM-style: `tokens[prefix_offset:read_offset]` is text
    already emitted (kept as context), `tokens[read_offset:]` is not emitted yet. Text that
    ends in U+FFFD (an incomplete UTF-8 character) is held back until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # NOTE: a prompt ending inside a character must not swallow the output's first bytes
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)

    def push(self, token_id: int) -> str:
        """Add one output token; return the new text it completes (often "", never a broken character)."""
        self._tokens.append(token_id)
        text = self._decode(self._tokens[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """At the end of the stream: the text held back so far (possibly ending in U+FFFD)."""
        if self._read_offset == len(self._tokens):
            return ""
        return self._advance(self._decode(self._tokens[self._prefix_offset:]))

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts a text stream at the first stop string, holding back text that may start one.

    The stop string itself is never emitted (OpenAI semantics). When several stop strings
    appear in the same delta, the one that starts earliest wins.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        text = self._pending + delta
        start = min((i for i in (text.find(stop) for stop in self._stops) if i >= 0), default=-1)
        if start >= 0:
            self._pending, self.stopped = "", True
            return text[:start], True
        keep = self._partial_stop_length(text)
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        pending, self._pending = self._pending, ""
        return pending

    def _partial_stop_length(self, text: str) -> int:
        longest = min(len(text), max((len(stop) for stop in self._stops), default=1) - 1)
        for length in range(longest, 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
