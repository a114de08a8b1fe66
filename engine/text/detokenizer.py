"""Streaming text: incremental detokenization, one token at a time (`tokenizers`' DecodeStream)."""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from pdserve.engine.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # tokens decoded in front of the new ones (leading-space rules of some decoders)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, one token at a time.

    `tokenizers.decoders.DecodeStream` does the work: it decodes a small window and holds back
    text that ends in U+FFFD (an incomplete UTF-8 character) until it completes. The last few
    prompt tokens seed it as context; a prompt that ends inside a character does not.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # NOTE: a prompt ending inside a character must not swallow the output's first bytes
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._ids = context                 # the context, then every output token
        self._emitted = len(context)        # ids[:emitted] have produced their text

    def push(self, token_id: int) -> str:
        """Add one output token; return the new text it completes (often "", never a broken character)."""
        self._ids.append(token_id)
        text = self._stream.step(self._backend, token_id)
        if text is None:
            return ""
        self._emitted = len(self._ids)
        return text

    def flush(self) -> str:
        """At the end of the stream: the text held back so far (possibly ending in U+FFFD)."""
        if self._emitted == len(self._ids):
            return ""
        context = self._ids[max(self._emitted - CONTEXT_TOKENS, 0):self._emitted]
        return self._decode(context + self._ids[self._emitted:])[len(self._decode(context)):]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
