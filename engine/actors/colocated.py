"""Colocated mode (the baseline): one device, chunked prefill mixed with decode in the same step."""
from __future__ import annotations

from pdserve.engine.actors.base import Actor, Emit
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.messages import Abort, Request
from pdserve.engine.core.scheduler import DecodeScheduler, PrefillScheduler, mixed_batch
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import DraftModel, SpeculativeConfig, speculator_for
from pdserve.engine.worker.compute import Compute


class ColocatedActor(Actor):
    name = "colocated"

    def __init__(self, unit: Compute, config: SchedulerConfig, kv_watermark: float,
                 max_model_len: int, emit: Emit, overlap: bool = False, prefix_caching: bool = False,
                 speculative: SpeculativeConfig | None = None, draft_model: DraftModel | None = None) -> None:
        super().__init__(unit, max_model_len, emit, overlap, prefix_caching)
        self.speculator = speculator_for(speculative, config.itl_slo_ms, draft_model)
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens = config.max_prefill_tokens
        self.kv_watermark = kv_watermark
        self.prefill = PrefillScheduler(self.blocks, config.max_prefill_tokens, config.max_num_seqs,
                                        pool_max_seqs=config.max_num_seqs, watermark=kv_watermark)
        self.decode = DecodeScheduler(self.blocks, config.max_num_seqs, on_preempt=self._requeue,
                                      max_model_len=max_model_len, speculator=self.speculator)

    def handle(self, message) -> None:
        if isinstance(message, Request):
            self.prefill.add(Sequence(message))
        elif isinstance(message, Abort):
            seq = self.prefill.find(message.request_id) or self.decode.find(message.request_id)
            if seq is not None:
                self.drop(seq)

    def prefill_schedulers(self) -> list[PrefillScheduler]:
        return [self.prefill]

    def schedule(self) -> Batch | None:
        return mixed_batch(self.decode, self.prefill, lambda decode_rows: self.max_prefill_tokens - decode_rows)

    def _requeue(self, seq: Sequence) -> None:
        """A preempted sequence: prefilled again later, its output so far kept."""
        self.leave(seq)
        self.prefill.add(Sequence(seq.request, list(seq.output_token_ids)))

    def clear(self) -> None:
        for seq in [*self.prefill.sequences(), *self.decode.running]:
            self.drop(seq)
        self.blocks.release_through(self.completed_step)

    def drop(self, seq: Sequence) -> None:
        self.prefill.remove(seq)
        self.decode.remove(seq)
        self.leave(seq)

    def prefill_queue(self):
        return self.prefill.sequences()

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.decode), len(self.prefill)
