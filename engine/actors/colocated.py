"""Colocated mode (the baseline): one device, chunked prefill mixed with decode in the same step."""
from __future__ import annotations

from engine.actors.base import Actor, Emit
from engine.core.admission import can_admit
from engine.core.batch import Batch
from engine.core.config import SchedulerConfig
from engine.core.messages import Abort, Request, StepOutput
from engine.core.scheduler import DecodeScheduler, PrefillScheduler
from engine.core.sequence import Sequence
from engine.worker.model_runner import ModelRunner
from engine.worker.step import StepResult


class ColocatedActor(Actor):
    name = "colocated"

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, kv_watermark: float,
                 max_model_len: int, emit: Emit, cpu_cores: tuple[int, ...] = (), overlap: bool = False) -> None:
        super().__init__(runner, max_model_len, emit, cpu_cores, overlap)
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens = config.max_prefill_tokens
        self.kv_watermark = kv_watermark
        self.prefill = PrefillScheduler(self.blocks, config.max_prefill_tokens, config.max_num_seqs,
                                        reserve=self._has_room)
        self.decode = DecodeScheduler(self.blocks, config.max_num_seqs, on_preempt=self._requeue,
                                      max_model_len=max_model_len)

    def _has_room(self, seq: Sequence) -> bool:
        return can_admit(self.blocks, seq.request_id, seq.num_tokens + 1, self.max_num_seqs, self.kv_watermark)

    def handle(self, message) -> None:
        if isinstance(message, Request):
            self.prefill.add(Sequence(message))
        elif isinstance(message, Abort):
            seq = self.prefill.find(message.request_id) or self.decode.find(message.request_id)
            if seq is not None:
                self.drop(seq)

    def schedule(self) -> Batch | None:
        decode = self.decode.schedule()
        chunks = self.prefill.schedule(self.max_prefill_tokens - len(decode))
        for chunk in chunks:
            if chunk.sample:                        # decodes from the next step on
                self.decode.add(chunk.seq)
        if not decode and not chunks:
            return None
        return Batch(decode, chunks)

    def record(self, batch: Batch, result: StepResult) -> StepOutput:
        output, recorded = self.record_tokens(batch.sampled, result)
        for seq, reason in recorded:
            if reason is not None:
                self.drop(seq)
        return output

    def _requeue(self, seq: Sequence) -> None:
        """A preempted sequence: prefilled again later, its output so far kept."""
        self.leave(seq)
        self.prefill.add(Sequence(seq.request, list(seq.output_token_ids)))

    def settle(self) -> None:
        for seq in [*self.prefill.sequences(), *self.decode.running]:
            self.drop(seq)
        self.blocks.release_through(self.completed_step)

    def drop(self, seq: Sequence) -> None:
        self.prefill.remove(seq)
        self.decode.remove(seq)
        self.leave(seq)

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.decode), len(self.prefill)
