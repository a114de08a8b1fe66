"""`--mode adaptive`: one engine that places each prefill and lends idle compute.

The decode actor also prefills, in its own steps and chunked under a budget from the placement
policy (`engine.actors.placement`), the prompts that are cheaper here; it forwards the others to
the prefill actor. On CPU the two actors' cores are one pool of threads: a side with nothing to
do lends its cores to the other, which takes them at its next step launch and gives them back at
the launch after the lender has work again (measured: switching thread counts per step costs
nothing, and an idle OpenMP team does not steal a busy thread's core: measured with 5507e67, which
added lending; bench/RESULTS.md, "Serving modes", shows what lending gives on the saturated load).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.actors.decode import DecodeActor
from engine.actors.placement import LoadState, PlacementPolicy, StepCostModel
from engine.actors.prefill import PrefillActor
from engine.core.batch import Batch
from engine.core.messages import Abort, Preempted, Request
from engine.core.prefix_cache import extend_hashes
from engine.core.scheduler import PrefillScheduler, mixed_batch
from engine.core.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CoreShare:
    """The CPU threads of the two actors; None on GPUs (nothing to lend by thread count)."""

    prefill_own: int
    decode_own: int

    @property
    def total(self) -> int:
        return self.prefill_own + self.decode_own


def borrowed_threads(actor: PrefillActor | DecodeActor, own: int | None,
                     partner: PrefillActor | DecodeActor) -> int | None:
    """Threads for `actor`'s next step: every core while `partner` has nothing to do (counted as a
    lent step), else its own; None on GPUs (`own` None: nothing is lent by thread count)."""
    if own is None:
        return None
    lent = not partner.busy
    actor.lent_steps += lent
    return actor.share.total if lent else own


class LendingPrefillActor(PrefillActor):
    """The prefill actor of adaptive mode: borrows the decode actor's cores while that one is idle."""

    def __init__(self, *args, cost: StepCostModel, share: CoreShare | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cost, self.share = cost, share
        self.partner: DecodeActor = self.decode
        self._inbound: dict[str, int] = {}      # prompts sent here and not yet handled: id -> tokens to compute

    def send(self, message) -> None:
        prompt = _prompt_of(message)
        if prompt is not None:
            self._inbound[prompt[0]] = prompt[1]
        super().send(message)

    def handle(self, message) -> None:
        prompt = _prompt_of(message)
        if prompt is not None:
            self._inbound.pop(prompt[0], None)
        super().handle(message)

    def step_threads(self) -> int | None:
        return borrowed_threads(self, self.share and self.share.prefill_own, self.partner)

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        self.cost.observe(threads, 0, sum(c.num_tokens for c in batch.chunks), seconds)

    def backlog_tokens(self) -> int:
        """Prompt tokens queued here, those still in the mailbox included (a burst is placed before this
        actor's loop has handled any of it)."""
        queued = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.scheduler.sequences())
        return queued + sum(self._inbound.values())

    def role(self) -> str:
        return "prefill" if self.busy else "lent" if self.partner.busy else "idle"


class AdaptiveDecodeActor(DecodeActor):
    """Decodes, prefills locally what the policy keeps here, forwards the rest; borrows idle prefill cores."""

    def __init__(self, *args, policy: PlacementPolicy, cost: StepCostModel, share: CoreShare | None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy, self.cost, self.share = policy, cost, share
        self.local = PrefillScheduler(self.blocks, self.policy.max_prefill_tokens, self.max_num_seqs,
                                      pool_max_seqs=self.max_num_seqs, watermark=self.kv_watermark)
        self.prefill_actor: LendingPrefillActor | None = None
        self._last_placement: bool | None = None

    # placement
    def handle(self, message) -> None:
        if isinstance(message, Request):
            self._place(Sequence(message))
        elif isinstance(message, Abort):
            seq = self.local.find(message.request_id)
            if seq is not None:
                self.drop(seq)
            super().handle(message)
        else:
            super().handle(message)

    def _place(self, seq: Sequence) -> None:
        decision = self.policy.place(self._uncached(seq, self.blocks), self._uncached(seq, self.prefill_actor.blocks),
                                     self._load())
        if decision.local != self._last_placement:
            logger.debug("placement %s: %s", "local" if decision.local else "remote", decision.reason)
            self._last_placement = decision.local
        if decision.local:
            self.local_prefills += 1
            self.local.add(seq)
        else:
            self.remote_prefills += 1
            self.send_to_prefill(seq.request)

    @staticmethod
    def _uncached(seq: Sequence, blocks) -> int:
        """Prompt tokens a pool would have to compute (its prefix-cache hits are free)."""
        if not blocks.enable_caching:
            return seq.num_tokens
        hits = blocks.match(extend_hashes(seq, seq.num_tokens, blocks.block_size)[:(seq.num_tokens - 1)
                                                                                    // blocks.block_size])
        return seq.num_tokens - len(hits) * blocks.block_size

    def _load(self, decode_rows: int | None = None) -> LoadState:
        prefill = self.prefill_actor
        queued = list(self.local.sequences())
        rows = len(self.scheduler) if decode_rows is None else decode_rows
        share = self.share
        return LoadState(rows, sum(s.num_tokens - s.num_computed_tokens for s in queued), prefill.backlog_tokens(),
                         share.total if share and not prefill.busy else share.decode_own if share else 1,
                         share.prefill_own if share else 1,
                         long_queued=any(s.num_tokens > self.policy.max_local for s in queued))

    # stepping
    def schedule(self) -> Batch | None:
        self._admit_landed()
        return mixed_batch(self.scheduler, self.local, lambda rows: self.policy.step_budget(self._load(rows)))

    def step_threads(self) -> int | None:
        return borrowed_threads(self, self.share and self.share.decode_own, self.prefill_actor)

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        drafts = sum(len(d) for d in batch.verify_drafts)      # verified like prefill tokens
        self.cost.observe(threads, len(batch.decode) + len(batch.verify),
                          sum(c.num_tokens for c in batch.chunks) + drafts, seconds)
        if batch.decode:
            carried_long = any(c.seq.num_tokens > self.policy.max_local for c in batch.chunks)
            self.policy.record_decode_step(threads, len(batch.decode), seconds, carried_long)

    def drop(self, seq: Sequence) -> None:
        self.local.remove(seq)
        super().drop(seq)

    def _send_back(self, seq: Sequence) -> None:
        """Preempted: placed again (its blocks stay cached here, so it usually comes back here)."""
        self.leave(seq)
        self._place(Sequence(seq.request, list(seq.output_token_ids)))
        self.on_blocks_freed()

    def settle(self) -> None:
        for seq in list(self.local.sequences()):
            self.drop(seq)
        super().settle()

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.scheduler) + len(self.landing), len(self.local)

    def role(self) -> str:
        return "decode" if self.busy else "lent" if self.prefill_actor.busy else "idle"


def _prompt_of(message) -> tuple[str, int] | None:
    """(request id, tokens to compute) of a prompt sent to the prefill actor; None for any other message."""
    if isinstance(message, Preempted):
        return message.request.request_id, len(message.request.prompt_token_ids) + len(message.output_token_ids)
    if isinstance(message, Request):
        return message.request_id, len(message.prompt_token_ids)
    return None
