"""What the SLO planner reads and answers: the load of a decode unit and its prefill partner, and the candidate
actions it predicts with the misses and throughput each causes."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.modes.adaptive.prefill_plans import Waiting


@dataclass(frozen=True, slots=True)
class Stream:
    """A sequence decoding: what its mean time between tokens has used and what it still takes."""

    gaps: int = 0                    # tokens it decoded since it was first seen decoding
    spent: float = 0.0               # seconds those took
    remaining: int | None = None     # the most tokens it may still take (None: unknown, counted as one;
                                     # 0: it ends with the step in flight, and nothing it waits for is missed)


@dataclass(frozen=True, slots=True)
class Running:
    """A prefill step in flight on the prefill unit (running, or launched behind the one that runs)."""

    tokens: int                      # prompt tokens it prefills
    pairs: int                       # the attention pairs its chunks read
    threads: int | None              # the threads it runs on


@dataclass(frozen=True, slots=True)
class LoadState:
    """What a decision reads off a decode unit and the prefill unit it would hand a prompt to."""

    decode_rows: int                         # sequences decoding on the decode unit
    local_queue: tuple[Waiting, ...] = ()    # prompts queued there for a local prefill, in order
    remote_backlog_tokens: int = 0           # prompt tokens queued on the prefill unit, beyond its steps in flight
    decode_threads: int | None = None        # threads of a decode step while the prefill unit works
    decode_threads_alone: int | None = None  # ... while it idles (its cores lent; the same off CPU)
    prefill_threads: int | None = None       # threads of a prefill step while the decode unit works
    prefill_busy: bool = False
    decode_context: int = 0                  # KV tokens the decoding rows read per step
    decode_remaining: int = 0                # the most tokens a decoding row may still take (0: unknown)
    streams: tuple[Stream, ...] = ()         # the decoding rows (fewer than `decode_rows`: the rest fresh)
    remote_running: tuple[Running, ...] = () # the prefill unit's steps in flight
    remote_running_for: float = 0.0          # seconds since the oldest of them was launched

    @property
    def local_threads(self) -> int | None:
        return self.decode_threads if self.prefill_busy else self.decode_threads_alone


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate action and what the cost models predict it causes."""

    action: str                      # a decode unit's "local", "wait" or "remote"; a prefill unit's "prefill" (a
                                     # full step) or "first prompts" (a step of its first prompts only)
    chunk: int                       # prefill tokens per decode step (local) or in the prefill unit's step, else 0
    ttft_misses: int
    itl_misses: int
    tokens_per_second: float
    first_token: float               # seconds until the last first token it decides
    step: float                      # the decode step meanwhile (seconds)
    streams: int = 0                 # the decoding streams meanwhile
    stall: float = 0.0               # seconds each of them waits for its tokens beyond decoding alone

    @property
    def misses(self) -> int:
        return self.ttft_misses + self.itl_misses

    @property
    def stalls(self) -> float:
        """Seconds the decoding streams together wait for their tokens beyond what decoding alone would take."""
        return self.streams * self.stall

    def describe(self) -> str:
        what = (f"local chunks of {self.chunk}" if self.action == "local" else
                f"{self.action} in a step of {self.chunk} tokens" if self.action in ("prefill", "first prompts") else
                self.action)
        return (f"{what}: {self.ttft_misses} TTFT + {self.itl_misses} ITL misses, first token in "
                f"{self.first_token:.3f}s, steps of {self.step * 1e3:.1f} ms, {self.tokens_per_second:.0f} tok/s")


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: Prediction
    candidates: tuple[Prediction, ...] = ()

    @property
    def local(self) -> bool:
        return self.chosen.action != "remote"

    @property
    def reason(self) -> str:
        others = "; ".join(p.describe() for p in self.candidates if p is not self.chosen)
        return self.chosen.describe() + (f" (over {others})" if others else "")


def best(candidates: Sequence[Prediction]) -> Prediction:
    """Fewest predicted misses; among equals the earliest first token (what a chat user notices first), then the
    least the streams stall (their ITL), then the most tokens per second; the earlier candidate on a tie. With the
    misses equal no stream is pushed past its SLO, so a prompt that can start now, on idle cores, does."""
    return min(candidates, key=lambda p: (p.misses, p.first_token, p.stalls, -p.tokens_per_second))
