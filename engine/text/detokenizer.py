"""Streaming text: incremental detokenization, one token at a time (`tokenizers`' DecodeStream)."""
from __future__ import annotations

import os
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from pdserve.engine.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # tokens decoded in front of the new ones (leading-space rules of some decoders)
MAX_CHARACTER_TOKENS = 4  # a character spelled in byte tokens (SentencePiece's byte fallback) takes up to four


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, one token at a time.

    `tokenizers.decoders.DecodeStream` does the work: it decodes a small window and holds back
    text that ends in U+FFFD (an incomplete UTF-8 character) until it completes. The last few
    prompt tokens seed it as context; a prompt that ends inside a character does not. DecodeStream
    raises where bytes it decoded as U+FFFD read differently once more arrive (SentencePiece's byte
    fallback after invalid UTF-8); from there the window is decoded here, and a new stream starts
    once its text is whole.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        prompt = list(prompt_token_ids)
        context = prompt[self._whole_from(prompt, len(prompt) - CONTEXT_TOKENS, len(prompt)):]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # NOTE: a prompt ending inside a character must not swallow the output's first bytes
        self._stream: DecodeStream | None = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._ids = context                 # the context, then every output token
        self._emitted = len(context)        # ids[:emitted] have produced their text

    def push(self, token_id: int) -> str:
        """Add one output token; return the new text it completes (often "", never a broken character)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:  # NOTE: tokenizers raises a bare Exception ("Invalid prefix encountered")
                self._stream = None
            else:
                if text is not None:
                    self._emitted = len(self._ids)
                return text or ""
        return self._window_step()

    def _window_step(self) -> str:
        """The text the tokens since the last emitted one complete, decoded with a few tokens before them as
        context; held back while it ends inside a character. A new DecodeStream continues from there."""
        start = self._whole_from(self._ids, self._emitted - CONTEXT_TOKENS, self._emitted)
        context = self._ids[start:self._emitted]
        before, text = self._decode(context), self._decode(context + self._ids[self._emitted:])
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        same = len(before) if text.startswith(before) else len(os.path.commonprefix([before, text]))
        self._emitted = len(self._ids)
        self._stream = DecodeStream(ids=self._ids[-CONTEXT_TOKENS:], skip_special_tokens=self._skip_special_tokens)
        return text[same:]

    def flush(self) -> str:
        """At the end of the stream: the text held back so far (possibly ending in U+FFFD)."""
        if self._emitted == len(self._ids):
            return ""
        context = self._ids[max(self._emitted - CONTEXT_TOKENS, 0):self._emitted]
        return self._decode(context + self._ids[self._emitted:])[len(self._decode(context)):]

    def _whole_from(self, ids: Sequence[int], start: int, end: int) -> int:
        """`start`, or up to MAX_CHARACTER_TOKENS earlier, so that ids[start:end] does not begin inside a
        character (byte fallback decodes a run of byte tokens that starts mid-character as U+FFFD throughout)."""
        start = max(start, 0)
        for earlier in range(start, max(start - MAX_CHARACTER_TOKENS, 0) - 1, -1):
            if not self._decode(ids[earlier:end]).startswith(REPLACEMENT_CHAR):
                return earlier
        return start

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
