"""Streaming text: incremental detokenization, one token at a time."""
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
