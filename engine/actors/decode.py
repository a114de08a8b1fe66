"""The decode actor: continuous batching over sequences whose KV arrived from a prefill unit."""
from __future__ import annotations

from pdserve.engine.actors.base import Actor, Emit
from pdserve.engine.actors.view import Decoding
from pdserve.engine.core.admission import cached_prefix, can_admit
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.messages import Abort, KVHandoff, Preempted, Reservation
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.scheduler import DecodeScheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import DraftModel, SpeculativeConfig, speculator_for
from pdserve.engine.transfer.base import first_pending
from pdserve.engine.worker.compute import Compute


class DecodeActor(Actor):
    """Owns the decode pool. `reserve`/`release` are called by the coordinator on the same loop."""

    name = "decode"

    def __init__(self, unit: Compute, config: SchedulerConfig, kv_watermark: float,
                 max_model_len: int, emit: Emit, overlap: bool = False, prefix_caching: bool = False,
                 speculative: SpeculativeConfig | None = None, draft_model: DraftModel | None = None) -> None:
        super().__init__(unit, max_model_len, emit, overlap, prefix_caching)
        self.speculator = speculator_for(speculative, config.itl_slo_ms, draft_model)
        self.max_num_seqs = config.max_num_seqs
        self.kv_watermark = kv_watermark
        self.scheduler = DecodeScheduler(self.blocks, config.max_num_seqs, on_preempt=self._send_back,
                                         max_model_len=max_model_len, speculator=self.speculator)
        self.landing: list[tuple[Sequence, tuple]] = []

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Blocks for a sequence about to be prefilled elsewhere, or None (back-pressure) above the watermark.

        Its prefix already cached here is shared, and only the blocks after it need to be copied in.
        """
        size, held = self.blocks.block_size, seq.num_tokens
        hits = cached_prefix(self.blocks, seq, held)      # NOTE: copied KV: no last token to compute here
        first = self.blocks.first_needed_block(held)      # the blocks behind the KV window are not copied
        if not can_admit(self.blocks, seq.request_id, held + 1, self.max_num_seqs, self.kv_watermark, hits, first,
                         window_from=held):
            return None
        self.blocks.count_lookup(held, len(hits) * size)
        mark = len(self.blocks.evicted or ())
        table = tuple(self.blocks.grow(seq.request_id, held + 1, prefix=hits, first_block=first, window_from=held))
        return Reservation(table, len(hits), self.index, tuple(self.blocks.take_evicted(mark)),
                           self.blocks.state_blocks(seq.request_id), self.blocks.window_blocks(seq.request_id))

    def release(self, request_id: str) -> None:
        """Give back a reservation that was never handed off (no step of this actor has used it)."""
        if self.blocks.free(request_id):
            self.port.blocks_freed(self)

    def handle(self, message) -> None:
        if isinstance(message, KVHandoff):
            seq = Sequence(message.request, list(message.output_token_ids), message.num_computed_tokens,
                           self.blocks.table(message.request.request_id), block_hashes=list(message.block_hashes),
                           num_cached_tokens=message.num_cached_tokens,
                           state_slot=self.blocks.state_slot(message.request.request_id))
            self.landing.append((seq, message.transfers))
        elif isinstance(message, Abort):
            self._abort(message.request_id)

    def _abort(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.drop(seq)
        for landing_seq, _ in self.landing:
            if landing_seq.request_id == request_id:
                landing_seq.aborted = True

    def schedule(self) -> Batch | None:
        self._admit_landed()
        decode = self.scheduler.schedule()
        return Batch.of(decode) if decode else None

    def _admit_landed(self) -> None:
        waiting = []
        for seq, transfers in self.landing:
            if not all(t.done() for t in transfers):
                waiting.append((seq, transfers))
            elif seq.aborted:
                self.release(seq.request_id)
            else:
                self._cache_arrived(seq)
                self.scheduler.add(seq)
        self.landing = waiting

    def _cache_arrived(self, seq: Sequence) -> None:
        """The copied blocks hold this sequence's KV now: the full ones join the prefix cache."""
        size = self.blocks.block_size
        full = seq.num_computed_tokens // size
        self.blocks.register(seq.request_id, extend_hashes(seq, full * size, size))
        seq.num_registered_blocks = full

    def drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.leave(seq)
        self.port.blocks_freed(self)

    def blocks_released(self) -> None:
        self.port.blocks_freed(self)

    def _send_back(self, seq: Sequence) -> None:
        self.leave(seq)
        self.port.post(Preempted(seq.request, tuple(seq.output_token_ids)))
        self.port.blocks_freed(self)

    def clear(self) -> None:
        for seq, transfers in self.landing:
            for transfer in transfers:
                transfer.wait()
            seq.aborted = True
        self._admit_landed()
        for seq in self.scheduler.running:
            self.drop(seq)
        self.blocks.release_through(self.completed_step)

    def pending_transfer(self):
        return first_pending(t for _, transfers in self.landing for t in transfers)

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.scheduler), len(self.landing)

    def decoding(self) -> tuple[Decoding, ...]:
        return tuple(Decoding(s.request_id, s.num_computed_tokens, len(s.output_token_ids), s.params.max_tokens,
                              s.done) for s in self.scheduler.running)
