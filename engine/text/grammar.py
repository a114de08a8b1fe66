"""Grammars for constrained decoding (llguidance): building them from request formats, checking them
against a model's tokenizer, and the matcher of one output."""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer

JSON_DEFAULTS = {"whitespace_flexible": False}     # compact JSON: a small model cannot ramble in whitespace


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> LLTokenizer:
    """llguidance's view of `model_dir`'s tokenizer.json over the model's `vocab_size` (built once: slow)."""
    text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def json_schema_grammar(schema: dict) -> str:
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)


def regex_grammar(pattern: str) -> str:
    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))


def lark_grammar(lark: str) -> str:
    return LLMatcher.grammar_from_lark(lark)


def grammar_error(grammar: str, tokenizer: LLTokenizer) -> str | None:
    """Why `grammar` cannot constrain this tokenizer's output exactly, or None when it can (a warning, such as
    a schema keyword llguidance would ignore, counts as a reason)."""
    try:
        _, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except (ValueError, TypeError) as e:
        return str(e)
    return "; ".join(messages) or None


class GrammarCache:
    """A fresh matcher per grammar text, compiled once and copied for each output (LRU over texts)."""

    def __init__(self, tokenizer: LLTokenizer, capacity: int = 256) -> None:
        self.tokenizer, self.capacity = tokenizer, capacity
        self._compiled: dict[str, LLMatcher] = {}

    def matcher(self, grammar: str, output_token_ids: Sequence[int]) -> LLMatcher:
        """A matcher that has consumed `output_token_ids` (an erroneous one if they break the grammar)."""
        template = self._compiled.pop(grammar, None)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar)
        self._compiled[grammar] = template
        if len(self._compiled) > self.capacity:
            del self._compiled[next(iter(self._compiled))]
        matcher = template.deep_copy()
        if output_token_ids:
            matcher.consume_tokens(list(output_token_ids))
        return matcher
