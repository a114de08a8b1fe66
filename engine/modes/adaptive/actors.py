"""The adaptive mode's actors. A decode unit also prefills, in its own steps and in chunks the mode's placement
(`placement.py`) sizes, the prompts it keeps there, and sends the others to a prefill unit. On CPU the two
units' cores are one pool of threads: a side whose partner idles may step on both sides' cores when the
planner predicts that faster; it gives them back at the launch after the partner has work again, and the
partner launches nothing until the lent step has ended. The partner's idle OpenMP workers are given back
when its cores are borrowed (`pdserve.engine.worker.openmp`).
"""
from __future__ import annotations

from pdserve.engine.actors.decode import DecodeActor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.actors.prefill import PrefillActor
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.messages import Abort, Request
from pdserve.engine.core.scheduler import PrefillScheduler, mixed_batch
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.units.spec import CoreShare


def step_threads(actor: PrefillActor | DecodeActor, batch: Batch, own: int | None) -> int | None:
    """Threads for `actor`'s next step, as the placement's planner decides (a step on more than its own is
    counted as a lent step); None on GPUs (`own` None: nothing is lent by thread count)."""
    if own is None:
        return None
    threads = actor.placement.step_threads(actor, batch, own, actor.share.total)
    actor.lent_steps += threads > own
    return threads


def returned_cores(actor: PrefillActor | DecodeActor, threads: int | None, own: int | None) -> None:
    """After a finished step: one on more than `own` threads ran on the partner's cores, which it gets back."""
    if own is not None and threads is not None and threads > own:
        actor.placement.cores_returned(actor)


class LendingPrefillActor(PrefillActor):
    """The prefill actor of adaptive mode: borrows the decode actor's cores while that one is idle."""

    def __init__(self, *args, cost: StepCostModel, share: CoreShare | None, placement, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cost, self.share, self.placement = cost, share, placement

    def priced(self) -> tuple[StepCostModel, int | None]:
        return self.cost, self.share and self.share.prefill_own

    def waits_for_cores(self) -> bool:
        return self.placement.cores_lent(self)

    def step_budget(self) -> int | None:
        return self.placement.prefill_budget(self)

    def step_threads(self, batch: Batch) -> int | None:
        return step_threads(self, batch, self.share and self.share.prefill_own)

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        self.cost.observe(threads, 0, batch.chunk_tokens, seconds, pairs=batch.chunk_pairs)
        returned_cores(self, threads, self.share and self.share.prefill_own)

    def role(self) -> str:
        return "prefill" if self.busy else "lent" if self.placement.partner_busy(self) else "idle"


class AdaptiveDecodeActor(DecodeActor):
    """Decodes, and prefills the prompts the coordinator's planner keeps here; borrows idle prefill cores."""

    def __init__(self, unit, config, *args, cost: StepCostModel, share: CoreShare | None, placement,
                 **kwargs) -> None:
        super().__init__(unit, config, *args, **kwargs)
        self.cost, self.share, self.placement = cost, share, placement
        self.local = PrefillScheduler(self.blocks, config.max_prefill_tokens, self.max_num_seqs,
                                      pool_max_seqs=self.max_num_seqs, watermark=self.kv_watermark)

    # placement (decided by the coordinator when this actor takes the prompt, on its own queue)
    def handle(self, message) -> None:
        if isinstance(message, Request):
            self._take(Sequence(message))
        elif isinstance(message, Abort):
            seq = self.local.find(message.request_id)
            if seq is not None:
                self.drop(seq)
            super().handle(message)
        else:
            super().handle(message)

    def _take(self, seq: Sequence) -> None:
        if self.placement.place(self, seq):
            self.local_prefills += 1
            self.local.add(seq)
        else:
            self.remote_prefills += 1

    def prefill_schedulers(self) -> list[PrefillScheduler]:
        return [self.local]

    # stepping
    def schedule(self) -> Batch | None:
        self._admit_landed()
        return mixed_batch(self.scheduler, self.local, lambda rows: self.placement.step_budget(self, rows))

    def step_threads(self, batch: Batch) -> int | None:
        return step_threads(self, batch, self.share and self.share.decode_own)

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        rows = batch.decoding
        self.cost.observe(threads, len(rows), batch.chunk_tokens, seconds,
                          context=sum(s.num_computed_tokens for s in rows), drafts=batch.num_drafts,
                          pairs=batch.chunk_pairs)
        returned_cores(self, threads, self.share and self.share.decode_own)
        super().observe_step(batch, seconds, threads)           # the speculator's own fit of decode steps

    def drop(self, seq: Sequence) -> None:
        self.local.remove(seq)
        super().drop(seq)

    def _send_back(self, seq: Sequence) -> None:
        """Preempted: placed again (its blocks stay cached here, so it usually comes back here)."""
        self.leave(seq)
        self._take(Sequence(seq.request, list(seq.output_token_ids)))
        self.port.blocks_freed(self)

    def prefill_queue(self):
        return self.local.sequences()

    def priced(self) -> tuple[StepCostModel, int | None]:
        return self.cost, self.share and self.share.decode_own

    def waits_for_cores(self) -> bool:
        return self.placement.cores_lent(self)

    def clear(self) -> None:
        for seq in list(self.local.sequences()):
            self.drop(seq)
        super().clear()

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.scheduler) + len(self.landing), len(self.local)

    def role(self) -> str:
        return "decode" if self.busy else "lent" if self.placement.partner_busy(self) else "idle"
