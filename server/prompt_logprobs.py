"""Prompt logprobs on the wire: vLLM's `prompt_logprobs` (null for the first prompt token, then per token a map of
token id to {logprob, rank, decoded_token}: the prompt token and the top alternatives at its position), and the
prompt's part of a legacy completion's `logprobs` when the prompt is echoed."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.core.messages import PromptLogprobs

class TokenText(Protocol):
    def __call__(self, token_id: int) -> str: ...
    def offsets(self, token_ids: Sequence[int]) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ScoredPrompt:
    """A choice's prompt and the engine's logprobs of its tokens after the first."""

    token_ids: tuple[int, ...]
    scores: PromptLogprobs


def vllm_prompt_logprobs(prompt: ScoredPrompt, top: int, token_text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs` with `top` alternatives per position."""
    entries: list[dict | None] = [None]
    s = prompt.scores
    for token_id, logprob, rank, alternatives in zip(s.token_ids, s.logprobs, s.ranks, s.top):
        entry = {str(token_id): _vllm_logprob(logprob, rank, token_text(token_id))}
        for place, (other, other_logprob) in enumerate(alternatives[:top]):
            entry.setdefault(str(other), _vllm_logprob(other_logprob, place + 1, token_text(other)))
        entries.append(entry)
    return entries


def _vllm_logprob(logprob: float, rank: int, text: str) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


def legacy_prompt_logprobs(prompt: ScoredPrompt, top: int, token_text: TokenText) -> dict:
    """`{tokens, token_logprobs, top_logprobs, text_offset}` of the prompt's tokens (null for the first), offsets
    into the echoed text."""
    s = prompt.scores
    return {"tokens": [token_text(t) for t in prompt.token_ids], "token_logprobs": [None, *s.logprobs],
            "top_logprobs": [None, *(top_by_text(token_text, t, lp, alternatives[:top])
                                     for t, lp, alternatives in zip(s.token_ids, s.logprobs, s.top))],
            "text_offset": token_text.offsets(prompt.token_ids)}


def top_by_text(token_text: TokenText, token_id: int, logprob: float,
                alternatives: Sequence[tuple[int, float]]) -> dict[str, float]:
    """A legacy `top_logprobs` entry: token text -> logprob of the alternatives, best first, then the token itself
    (OpenAI's "up to logprobs + 1"); two tokens with the same text keep the better logprob."""
    top: dict[str, float] = {}
    for other, other_logprob in alternatives:
        top.setdefault(token_text(other), other_logprob)
    top.setdefault(token_text(token_id), logprob)
    return top
