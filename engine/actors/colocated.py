"""Colocated mode (the baseline): one device, chunked prefill mixed with decode in the same step."""
from __future__ import annotations

from engine.actors.base import Actor, Emit
from engine.core.admission import can_admit
from engine.core.batch import Batch
from engine.core.config import SchedulerConfig
from engine.core.messages import Abort, Request
from engine.core.scheduler import DecodeScheduler, PrefillScheduler
from engine.core.sequence import Sequence
from engine.worker.model_runner import ModelRunner


class ColocatedActor(Actor):
    name = "colocated"

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, kv_watermark: float,
                 max_model_len: int, emit: Emit, cpu_cores: tuple[int, ...] = ()) -> None:
        super().__init__(runner, max_model_len, emit, cpu_cores)
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens = config.max_prefill_tokens
        self.kv_watermark = kv_watermark
        self.prefill = PrefillScheduler(self.blocks, config.max_prefill_tokens, config.max_num_seqs,
                                        reserve=self._has_room)
        self.decode = DecodeScheduler(self.blocks, config.max_num_seqs, on_preempt=self.prefill.add)

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
        decode_chunks = decode.chunks if decode else ()
        prefill = self.prefill.schedule(self.max_prefill_tokens - len(decode_chunks))
        prefill_chunks = prefill.chunks if prefill else ()
        if not decode_chunks and not prefill_chunks:
            return None
        return Batch(decode_chunks + prefill_chunks, is_decode=not prefill_chunks)

    def execute(self, batch: Batch):
        return self.runner.execute(batch)

    def postprocess(self, batch: Batch, result) -> None:
        for chunk in batch.chunks:
            chunk.seq.num_computed_tokens = chunk.stop
        for chunk, (token_id, logprob) in zip(batch.sampled, result):
            seq = chunk.seq
            was_prefill = self.prefill.is_admitted(seq)
            if self.record_token(seq, token_id, logprob) is not None:
                self.drop(seq)
            elif was_prefill:
                self.prefill.remove(seq)
                self.decode.add(seq)

    def settle(self) -> None:
        for seq in [*self.prefill.sequences(), *self.decode.running]:
            self.drop(seq)

    def drop(self, seq: Sequence) -> None:
        self.prefill.remove(seq)
        self.decode.remove(seq)
        self.blocks.free(seq.request_id)

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.decode), len(self.prefill)
