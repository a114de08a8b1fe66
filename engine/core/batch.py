"""What a scheduler hands to a model runner for one step (plain Python, no tensors)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int            # position of the first token computed this step
    num_tokens: int
    sample: bool          # the chunk ends at the sequence's newest token: sample the next one

    @property
    def stop(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class Batch:
    chunks: tuple[ScheduledChunk, ...]
    is_decode: bool        # every chunk is one token of a running sequence

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampled(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.sample]
