"""Suffix decoding drafts (Snowflake's SuffixDecoding, vLLM's "suffix" method) in numpy.

What Arctic Inference's depth-bounded suffix trees count, read off the token arrays directly, over one request's
prompt and output and over earlier requests' outputs (`SuffixCache`); the draft of highest expected accepted
tokens wins. docs/speculative.md ("The suffix method") gives the walk, its limits and the ties.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1               # ends a sequence in a text array; never a token
MIN_TAIL_TO_INDEX = 4096     # cache tokens appended since the last index build that a lookup scans linearly
SMALL_SET = 64               # continuations counted in plain Python below this many occurrences


@dataclass(frozen=True, slots=True)
class SuffixParams:
    max_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_spec_offset: float = 0.0

    def budget(self, match_len: int, max_tokens: int) -> int:
        """Draft tokens a match of `match_len` may propose."""
        scaled = int(match_len * self.max_spec_factor + self.max_spec_offset + 1e-6)
        return max(0, min(max_tokens, scaled, self.max_depth - match_len))


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0


def propose_suffix(text: np.ndarray, n: int, cache: SuffixCache | None, max_tokens: int,
                   params: SuffixParams) -> SuffixDraft:
    """The best draft for the context `text[:n]` from the context itself and from `cache`.

    `text` must hold SEPARATOR at index n (the caller keeps one slot past the context)."""
    if n < 2 or max_tokens <= 0:
        return SuffixDraft()
    pattern = text[max(0, n - params.max_depth):n]
    ends = np.flatnonzero(text[:n - 1] == pattern[-1])
    best = speculate(text, ends, pattern, 1, max_tokens, params)     # NOTE: the context's own occurrence counts
    if cache is not None and cache.num_tokens:
        best = speculate(cache.text, cache.ends_of(int(pattern[-1])), pattern, 0, max_tokens, params, best)
    return best


def speculate(text: np.ndarray, ends: np.ndarray, pattern: np.ndarray, self_count: int, max_tokens: int,
              params: SuffixParams, best: SuffixDraft = SuffixDraft()) -> SuffixDraft:
    """The draft of highest score (ties: the longer match) over match lengths if it beats `best`, else `best`,
    given `ends`: where the pattern's last token occurs in `text` (ascending); `self_count` more
    occurrences (the context's own) have no continuation."""
    longest = min(len(pattern) - 1, params.max_depth - 1)
    if longest < 1 or not len(ends):
        return best
    matched = match_lengths(text, ends, pattern, longest)
    lengths = np.unique(matched).tolist()
    for shortest, length in reversed(list(zip([0, *lengths], lengths))):    # longest matches first
        group = range(length, shortest, -1)               # these match lengths share one set of occurrences
        budgets = [params.budget(m, max_tokens) for m in group]
        if max(budgets) <= best.score:                    # NOTE: a score is at most its draft's length
            continue
        at = ends[matched >= length]
        tokens, probs = walk(text, at, len(at) + self_count, max(budgets), params.min_token_prob)
        for m, budget in zip(group, budgets):
            score = float(sum(probs[:budget]))
            if score > best.score:
                best = SuffixDraft(tuple(tokens[:budget]), tuple(probs[:budget]), score, m)
    return best


def match_lengths(text: np.ndarray, ends: np.ndarray, pattern: np.ndarray, longest: int) -> np.ndarray:
    """How many of the pattern's last tokens (at most `longest`) end at each of `ends`."""
    back = ends[:, None] - np.arange(longest)                 # [occurrences, longest]: p, p - 1, ...
    same = (back >= 0) & (text[np.maximum(back, 0)] == pattern[::-1][:longest])
    return np.where(same.all(axis=1), longest, same.argmin(axis=1))


def walk(text: np.ndarray, ends: np.ndarray, count: int, budget: int, min_prob: float) -> tuple[list, list]:
    """Follow the most frequent continuation of the string ending at `ends` (occurring `count` times)."""
    tokens: list[int] = []
    probs: list[float] = []
    prob, at = 1.0, ends
    while len(tokens) < budget and len(at):
        if len(at) == 1:
            run = _run(text, int(at[0]) + 1, budget - len(tokens))
            prob *= 1.0 / count
            if len(run) and prob >= min_prob:
                tokens += run
                probs += [prob] * len(run)
            break
        following = text[at + 1]
        token, times = most_frequent(following[following != SEPARATOR])
        prob *= times / count
        if times == 0 or prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        at = at[following == token] + 1
        count = len(at)
    return tokens, probs


def _run(text: np.ndarray, start: int, limit: int) -> list[int]:
    """Up to `limit` tokens from `start`, stopping at a separator."""
    run = text[start:start + limit]
    stop = np.flatnonzero(run == SEPARATOR)
    return (run[:stop[0]] if len(stop) else run).tolist()


def most_frequent(values: np.ndarray) -> tuple[int, int]:
    """(the most frequent value, its count); among equally frequent ones the last in `values`; (-1, 0) if empty."""
    if len(values) <= SMALL_SET:
        counts: dict[int, int] = {}
        for value in values.tolist():
            counts[value] = counts.pop(value, 0) + 1       # NOTE: re-inserted: the newest goes last
        top = max(counts.values(), default=0)
        return next((v for v in reversed(counts) if counts[v] == top), SEPARATOR), top
    unique, counts = np.unique(values, return_counts=True)
    top = counts.max()
    winners = unique[counts == top]
    if len(winners) == 1:
        return int(winners[0]), int(top)
    return int(values[np.isin(values, winners)][-1]), int(top)


class SuffixCache:
    """Outputs of earlier requests, at most `max_requests` of them (the oldest goes first), as one text.

    The text starts with a separator and each output ends with one. Positions are found through an
    index sorted by token, rebuilt once the tokens appended since (scanned linearly meanwhile) exceed
    a quarter of it; evicted outputs are cut off the front at a rebuild once they are half the text.
    """

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._text = np.full(1024, SEPARATOR, dtype=np.int64)
        self._length = 1
        self._start = 1                  # positions before it belong to evicted outputs
        self._lengths: deque[int] = deque()
        self._sorted_tokens = np.zeros(0, dtype=np.int64)
        self._sorted_positions = np.zeros(0, dtype=np.int64)
        self._indexed = 0

    @property
    def num_requests(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._length - self._start

    @property
    def text(self) -> np.ndarray:
        return self._text[:self._length]

    def outputs(self) -> list[list[int]]:
        """The cached outputs, oldest first."""
        live = self._text[self._start:self._length].tolist()
        out, at = [], 0
        for length in self._lengths:
            out.append(live[at:at + length - 1])
            at += length
        return out

    def add(self, tokens) -> None:
        """Cache one finished request's output (evicting the oldest beyond `max_requests`)."""
        if self.max_requests <= 0 or not len(tokens):
            return
        need = self._length + len(tokens) + 2
        if need > len(self._text):
            grown = np.full(max(need, 2 * len(self._text)), SEPARATOR, dtype=np.int64)
            grown[:self._length] = self._text[:self._length]
            self._text = grown
        self._text[self._length:self._length + len(tokens)] = tokens
        self._length += len(tokens) + 1         # the separator after it is already there
        self._lengths.append(len(tokens) + 1)
        while len(self._lengths) > self.max_requests:
            self._start += self._lengths.popleft()
        if self._length - self._indexed > max(MIN_TAIL_TO_INDEX, self._indexed // 4):
            self._reindex()

    def ends_of(self, token: int) -> np.ndarray:
        """Where `token` occurs in the live outputs, ascending."""
        lo, hi = np.searchsorted(self._sorted_tokens, [token, token + 1])
        indexed = self._sorted_positions[lo:hi]
        indexed = indexed[np.searchsorted(indexed, self._start):]
        scanned = max(self._indexed, self._start)
        tail = np.flatnonzero(self._text[scanned:self._length] == token) + scanned
        return np.concatenate((indexed, tail)) if len(tail) else indexed

    def _reindex(self) -> None:
        if self._start - 1 > self._length // 2:
            live = self._text[self._start:self._length]
            self._text[1:1 + len(live)] = live
            self._text[1 + len(live):self._length + 1] = SEPARATOR
            self._length, self._start = 1 + len(live), 1
        order = np.argsort(self._text[:self._length], kind="stable")
        self._sorted_positions = order
        self._sorted_tokens = self._text[order]
        self._indexed = self._length
