"""The prefill actor: chunked prefill, first token, and the KV hand-off to a decode unit.

Decode blocks are reserved through the coordinator (its port) before a prompt is admitted: no room on
any decode unit holds the prompt back. Each chunk's finished blocks are copied into the reserved
blocks of that decode unit's pool, and the hand-off goes to the coordinator, which delivers it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.actors.base import Actor, Emit
from pdserve.engine.core.batch import Batch, ScheduledChunk
from pdserve.engine.core.block_manager import NO_BLOCK, blocks_for
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.messages import Abort, FinishReason, KVHandoff, Preempted, Release, Request, StepOutput
from pdserve.engine.core.scheduler import PrefillScheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.transfer.base import first_pending
from pdserve.engine.worker.compute import Compute
from pdserve.engine.worker.step import BlockCopy, StepWork
from pdserve.engine.worker.step_runner import StepOutcome


@dataclass(slots=True, eq=False)
class Outgoing:
    """An admitted sequence's copies; its prefill blocks are freed once they all landed."""

    seq: Sequence
    decode_blocks: tuple[int, ...]
    decode_cached: int              # leading decode blocks the decode pool already held: not copied
    decode_unit: int                # which decode unit holds the reservation
    decode_state_blocks: tuple[int, ...] = ()     # its state slot there: copied with the last chunk's blocks
    decode_window_blocks: tuple[tuple[int, ...], ...] = ()   # per decode block, its window slot's blocks there
    transfers: list = field(default_factory=list)
    handed_off: bool = False        # the decode unit owns the reservation now

    def landed(self) -> bool:
        return all(t.done() for t in self.transfers)


class PrefillActor(Actor):
    name = "prefill"

    def __init__(self, unit: Compute, config: SchedulerConfig, max_model_len: int,
                 emit: Emit, overlap: bool = False, prefix_caching: bool = False) -> None:
        """`unit` runs the steps and copies each chunk's finished blocks into a decode unit's pool."""
        super().__init__(unit, max_model_len, emit, overlap, prefix_caching)
        self.scheduler = PrefillScheduler(self.blocks, config.max_prefill_tokens, config.max_num_seqs,
                                          reserve=self._reserve_decode_blocks)
        self.outgoing: dict[str, Outgoing] = {}
        self.retiring: list[Outgoing] = []
        self.transfer_seconds: deque[float] = deque(maxlen=10_000)
        self.kv_verify_mismatches = 0    # hand-off copies --kv-verify found different at the two ends

    def handle(self, message) -> None:
        if isinstance(message, Request):
            self.scheduler.add(Sequence(message))
        elif isinstance(message, Preempted):
            self.scheduler.add(Sequence(message.request, list(message.output_token_ids)))
        elif isinstance(message, Abort):
            seq = self._find(message.request_id)
            if seq is not None:
                self.drop(seq)

    def _find(self, request_id: str) -> Sequence | None:
        out = self.outgoing.get(request_id)
        if out is not None and not out.seq.done:        # its last chunk is in flight
            return out.seq
        return self.scheduler.find(request_id)

    def _reserve_decode_blocks(self, seq: Sequence) -> bool:
        reservation = self.port.reserve(seq)
        if reservation is None:
            return False
        self.outgoing[seq.request_id] = Outgoing(seq, reservation.blocks, reservation.num_cached, reservation.unit,
                                                 reservation.state_blocks, reservation.window_blocks)
        if reservation.evicted and self.tier_plan is not None:     # NOTE: saved before this step copies into them
            self.tier_plan.peer_evicted(reservation.unit, reservation.evicted)
        return True

    def prefill_schedulers(self) -> list[PrefillScheduler]:
        return [self.scheduler]

    def schedule(self) -> Batch | None:
        self._retire_landed()
        chunks = self.scheduler.schedule(self.step_budget())
        return Batch.of(chunks=chunks) if chunks else None

    def step_budget(self) -> int | None:
        """Prompt tokens the next step carries (None: `--max-prefill-tokens`)."""
        return None

    def prepare(self, batch: Batch) -> StepWork:
        copies = tuple(copy for chunk in batch.chunks if (copy := self._finished_blocks(chunk)) is not None)
        return StepWork(self.rows.step_input(batch, self.blocks.take_window_assignments()), copies)

    def _finished_blocks(self, chunk: ScheduledChunk) -> BlockCopy | None:
        """The blocks this chunk completes (the partial last one too, after the last chunk) that the
        decode pool does not hold yet; the first chunk also sends the prefix found in this pool's cache. The last
        chunk also sends the sequence's state slot (a model with recurrent layers): its state after the prompt."""
        size, seq = self.unit.block_size, chunk.seq
        out = self.outgoing[seq.request_id]
        start = 0 if chunk.start == seq.num_cached_tokens else chunk.start   # the first chunk sends the hits too
        first = max(start // size, out.decode_cached)
        last = blocks_for(chunk.stop, size) if chunk.sample else chunk.stop // size
        pairs = [(s, d) for s, d in zip(seq.block_table[first:last], out.decode_blocks[first:last])
                 if NO_BLOCK not in (s, d)]                 # NOTE: behind the KV window: never read there
        src, dst = tuple(s for s, _ in pairs), tuple(d for _, d in pairs)
        if out.decode_window_blocks:                      # NOTE: only blocks inside the window there have slots
            here = self.blocks.window_blocks(seq.request_id, first, last)
            slots = [(s, d) for s, d in zip(here, out.decode_window_blocks[first:last]) if s and d]
            src += tuple(b for s, _ in slots for b in s)
            dst += tuple(b for _, d in slots for b in d)
        if chunk.sample:
            src, dst = src + self.blocks.state_blocks(seq.request_id), dst + out.decode_state_blocks
        return BlockCopy(seq.request_id, src, dst, out.decode_unit) if src else None

    def record(self, batch: Batch, outcome: StepOutcome) -> StepOutput:
        for request_id, handle in outcome.copies:
            self.outgoing[request_id].transfers.append(handle)
        self.kv_verify_mismatches += outcome.check.mismatches
        for request_id in outcome.check.failed:
            self._copy_failed(self.outgoing[request_id].seq)
        output, recorded = self.record_tokens(batch.sampled, outcome, self.record_prompt_logprobs(batch, outcome))
        for seq, reason in recorded:
            out = self.outgoing[seq.request_id]
            if reason is None:
                self.port.post(KVHandoff(seq.request, seq.num_tokens - 1, tuple(seq.output_token_ids),
                                         tuple(out.transfers), tuple(seq.block_hashes), seq.num_cached_tokens,
                                         out.decode_unit))
                out.handed_off = True
            self.leave(seq)
        self._retire_landed()
        return output

    def _copy_failed(self, seq: Sequence) -> None:
        """`seq`'s KV reached its decode unit different twice (--kv-verify): it ends with an error, never decoded."""
        if not seq.done:
            self.emit(StepOutput((seq.request_id,), (-1,), (FinishReason.ERROR,),
                                 error="request failed: its KV copy to the decode unit differed from the prefilled "
                                       "blocks twice (--kv-verify)"))
            self.drop(seq)

    def leave(self, seq: Sequence) -> None:
        """Done on this actor: its row goes now, its blocks once its copies have landed."""
        self.scheduler.remove(seq)
        seq.done = True
        self.rows.release_row(seq)
        out = self.outgoing.get(seq.request_id)
        if out is not None and out.seq is seq and out not in self.retiring:
            self.retiring.append(out)

    def drop(self, seq: Sequence) -> None:
        self.leave(seq)

    def _retire_landed(self) -> None:
        still_copying = []
        for out in self.retiring:
            if not out.landed() or out.seq.last_step > self.completed_step:
                still_copying.append(out)
                continue
            self.blocks.free(out.seq.request_id)
            if not out.handed_off:
                self.port.post(Release(out.seq.request_id, out.decode_unit))
            del self.outgoing[out.seq.request_id]
            self.transfer_seconds.extend(t.seconds for t in out.transfers if t.seconds is not None)
        self.retiring = still_copying

    def pending_transfer(self):
        return first_pending(t for out in self.retiring for t in out.transfers)

    def prefill_queue(self):
        return self.scheduler.sequences()

    def prefill_order(self) -> list[Sequence]:
        return self.scheduler.in_order()

    def copies_to(self, decode_unit: int) -> list:
        """The copies started or landed into `decode_unit`'s pool that this actor still tracks."""
        return [t for out in self.outgoing.values() if out.decode_unit == decode_unit for t in out.transfers]

    def clear(self) -> None:
        for seq in list(self.scheduler.sequences()):
            self.drop(seq)
        for out in self.retiring:
            for transfer in out.transfers:
                transfer.wait()
        self._retire_landed()

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.outgoing), len(self.scheduler)
