"""What a scheduler hands to an actor for one step (plain Python, no tensors)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.core.sequence import Sequence


def attention_pairs(start: int, tokens: int) -> int:
    """The query-key pairs causal attention reads for `tokens` prompt tokens after `start` computed ones."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Prompt tokens start .. stop - 1 of `seq`, computed in one step (a prefill chunk)."""

    seq: Sequence
    start: int            # position of the first token computed this step
    num_tokens: int
    sample: bool          # the chunk ends at the sequence's newest token: sample the next one

    @property
    def stop(self) -> int:
        return self.start + self.num_tokens

    @property
    def pairs(self) -> int:
        return attention_pairs(self.start, self.num_tokens)


@dataclass(frozen=True, slots=True)
class Batch:
    """One step: `decode` sequences compute one token each and sample the next; `chunks` are prefill.

    Decode rows come first in the model's batch, then the chunks in order. A decode sequence's
    position is its `num_computed_tokens` before the step was scheduled.
    """

    @classmethod
    def of(cls, decode: tuple[Sequence, ...] = (), chunks: tuple[ScheduledChunk, ...] = ()) -> "Batch":
        """A batch of sequences just scheduled: decode positions read off `num_computed_tokens`.

        A decode sequence holding drafts (`Sequence.drafts`) verifies them: it goes to `verify`."""
        if not any(s.drafts for s in decode):
            return cls(decode, chunks, tuple([s.num_computed_tokens - 1 for s in decode]))
        plain = tuple(s for s in decode if not s.drafts)
        verify = tuple(s for s in decode if s.drafts)
        return cls(plain, chunks, tuple([s.num_computed_tokens - 1 for s in plain]), verify,
                   tuple([s.num_computed_tokens - 1 - len(s.drafts) for s in verify]),
                   tuple([s.drafts for s in verify]))

    def landed(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens whose KV exists once this step has run), for every sequence in it.

        A verifying sequence counts only its input token: which drafts are kept is known later."""
        return ([(s, p + 1) for s, p in zip(self.decode, self.decode_positions)]
                + [(s, p + 1) for s, p in zip(self.verify, self.verify_positions)]
                + [(c.seq, c.stop) for c in self.chunks])

    decode: tuple[Sequence, ...] = ()
    chunks: tuple[ScheduledChunk, ...] = ()
    decode_positions: tuple[int, ...] = ()      # the position each decode sequence computes
    verify: tuple[Sequence, ...] = ()           # decode sequences verifying drafts: 1 + len(drafts) positions
    verify_positions: tuple[int, ...] = ()      # the position of each one's input token (its first)
    verify_drafts: tuple[tuple[int, ...], ...] = ()

    @property
    def is_decode(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + self.chunk_tokens + sum(1 + len(d) for d in self.verify_drafts)

    @property
    def decoding(self) -> tuple[Sequence, ...]:
        """The sequences decoding this step: the plain decode rows, then the verifying ones."""
        return self.decode + self.verify

    @property
    def chunk_tokens(self) -> int:
        """Prompt tokens the chunks prefill."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def chunk_pairs(self) -> int:
        """Attention pairs the prompt chunks read (each token attends to every earlier one of its prompt)."""
        return sum(c.pairs for c in self.chunks)

    @property
    def num_drafts(self) -> int:
        """Draft tokens the verifying rows check this step."""
        return sum(len(d) for d in self.verify_drafts)

    @property
    def sampled(self) -> tuple[Sequence, ...]:
        """The sequences that get a token from this step, in result order."""
        return self.decode + tuple(c.seq for c in self.chunks if c.sample)

    def sequences(self) -> tuple[Sequence, ...]:
        return self.decode + self.verify + tuple(c.seq for c in self.chunks)
