"""What a unit answers when the coordinator asks (routing, the adaptive planner, /metrics): read-only
figures of its queues, its steps in flight, its pool and its cost model, never its schedulers themselves."""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.admission import cached_prefix, uncached_tokens
from pdserve.engine.core.messages import ActorStats
from pdserve.engine.core.sequence import Sequence


class Queued(NamedTuple):
    """A prompt queued for prefill: its tokens still to compute, its arrival time (0: none), its tokens."""

    tokens: int
    arrival: float
    length: int


class Decoding(NamedTuple):
    """A sequence decoding here: its request, the KV tokens its step reads, its output so far and its limit."""

    request_id: str
    context: int
    output_tokens: int
    max_tokens: int
    done: bool


class PrefillStep(NamedTuple):
    """A step in flight that prefills: its prompt tokens, their attention pairs, its threads (None: its own)."""

    tokens: int
    pairs: int
    threads: int | None


class UnitView:
    """Mixed into the Actor."""

    kv_verify_mismatches = 0         # hand-off copies --kv-verify found different (a prefill actor counts them)

    @property
    def step_started_at(self) -> float | None:
        return self._in_flight[0].started if self._in_flight else None

    @property
    def prefill_tokens_in_flight(self) -> int:
        """Prompt tokens the steps in flight prefill: scheduled, so no longer in `backlog_tokens`."""
        return sum(step.batch.chunk_tokens for step in self._in_flight)

    def backlog_tokens(self) -> int:
        """Prompt tokens queued here for prefill, those still in the mailbox included (a burst is routed
        before this actor's loop has handled any of it)."""
        queued = sum(self.to_compute(seq) for seq in self.prefill_queue())
        return queued + self._mailbox.prompt_tokens

    def to_compute(self, seq: Sequence) -> int:
        """Prompt tokens of queued `seq` still to compute here: once admitted (holding blocks), those past what it
        has computed or taken from a cache; before, those past its prefix-cache and tier hits here."""
        if seq.num_computed_tokens or self.blocks.holds(seq.request_id):
            return seq.num_tokens - seq.num_computed_tokens
        return self.uncached_tokens(seq)

    def prefill_queue(self) -> Iterator[Sequence]:
        """The sequences waiting here for (more of) their prefill."""
        return iter(())

    def stats(self) -> ActorStats:
        running, waiting = self.queue_lengths()
        b = self.blocks
        return ActorStats(self.name, running=running, waiting=waiting, kv_blocks_used=b.num_used,
                          kv_blocks_total=b.num_blocks, steps=self.steps, last_step_time=self.last_step_time,
                          alive=self.alive, prefix_cache_queries=b.prefix_queries, prefix_cache_hits=b.prefix_hits,
                          role=self.role(), lent_steps=self.lent_steps, local_prefills=self.local_prefills,
                          remote_prefills=self.remote_prefills, unit=self.unit_name,
                          routed_prefill=self.routed_prefill, routed_decode=self.routed_decode,
                          kv_verify_mismatches=self.kv_verify_mismatches, **self._spec_stats())

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_drafts": c.num_drafts, "spec_draft_tokens": c.num_draft_tokens,
                "spec_accepted_tokens": c.num_accepted_tokens,
                "spec_accepted_per_position": tuple(c.accepted_per_position)}

    def role(self) -> str:
        """What this actor's compute does now (adaptive mode lends it; the fixed modes keep their role)."""
        return self.name

    @property
    def busy(self) -> bool:
        """Has sequences to run, a step in flight or messages not yet handled (a prompt sent to it)."""
        running, waiting = self.queue_lengths()
        return bool(running or waiting or self._in_flight or self._mailbox)

    def prefill_work(self) -> int:
        """Prompt tokens to prefill here before a new prompt: the queue and the steps in flight."""
        return self.backlog_tokens() + self.prefill_tokens_in_flight

    def uncached_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` this unit would compute: neither in its prefix cache nor, after that, in a KV tier."""
        return uncached_tokens(self.blocks, seq, self.tier_plan and self.tier_plan.tiers)

    def cached_blocks(self, seq: Sequence) -> int:
        """Blocks of `seq`'s tokens this unit's prefix cache holds."""
        return len(cached_prefix(self.blocks, seq, seq.num_tokens))

    @property
    def sequences_held(self) -> int:
        """Sequences holding blocks here (reserved, landing, prefilling or decoding)."""
        return self.blocks.num_sequences

    def priced(self) -> tuple[StepCostModel, int | None] | None:
        """The unit's step cost model and the threads its own steps run on; None where it keeps none."""
        return None

    def queued(self) -> tuple[Queued, ...]:
        """The prompts queued here for (more of) their prefill, in the order they will be scheduled."""
        return tuple(Queued(self.to_compute(s), s.request.arrival_time, s.num_tokens) for s in self.prefill_order())

    def prefill_order(self) -> list[Sequence]:
        """`prefill_queue` in the order it will be scheduled."""
        return list(self.prefill_queue())

    def decoding(self) -> tuple[Decoding, ...]:
        """The sequences decoding here."""
        return ()

    def prefill_steps(self) -> tuple[PrefillStep, ...]:
        """The steps in flight that prefill (their chunks are no longer in the queue)."""
        return tuple(PrefillStep(tokens, step.batch.chunk_pairs, step.threads)
                     for step in self._in_flight if (tokens := step.batch.chunk_tokens))
