"""--reasoning-parser: a reasoning model's `<think>...</think>` text apart from its answer, as vLLM's qwen3 and
deepseek_r1 parsers split it.

Everything before `</think>` is reasoning (the chat template usually writes `<think>` into the prompt; a
`<think>` the model writes itself is dropped); without `</think>` the whole output is reasoning. A prompt that
already closed the reasoning (Qwen3's template with `enable_thinking: false` writes `<think>\\n\\n</think>`), or
qwen3 with `enable_thinking` false, makes the whole output content.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

THINK, END = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's output text, fed as it streams, split into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._start_dropped = False
        self._pending = ""                   # a tail that may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        text, self._pending = self._pending + text, ""
        if not self._start_dropped:
            start, end = text.find(THINK), text.find(END)
            if start >= 0 and (end < 0 or start < end):
                text, self._start_dropped = text[:start] + text[start + len(THINK):], True
        end = text.find(END)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(END):]
        held = _tag_prefix_at_end(text, (END,) if self._start_dropped else (END, THINK))
        self._pending = text[len(text) - held:]
        return text[:len(text) - held], ""

    def finish(self) -> tuple[str, str]:
        """What is held back, once the output has ended: reasoning cut short by the end of the output."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)


class ReasoningParser:
    """A --reasoning-parser: makes each request's splitters from its rendered prompt and template options."""

    def __init__(self, name: str) -> None:
        self.name = name

    def in_reasoning_at_start(self, prompt_text: str, template_kwargs: Mapping[str, Any]) -> bool:
        if self.name == "qwen3" and template_kwargs.get("enable_thinking") is False:
            return False
        return not prompt_ends_reasoning(prompt_text)

    @staticmethod
    def split(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content), each None when empty (vLLM's message fields)."""
        splitter = ReasoningSplitter(in_reasoning)
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return reasoning + more_reasoning or None, content + more_content or None


def prompt_ends_reasoning(prompt_text: str) -> bool:
    """Whether the prompt's last think tag closes its reasoning."""
    return prompt_text.rfind(END) > prompt_text.rfind(THINK)


def _tag_prefix_at_end(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    for size in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in tags):
            return size
    return 0
