"""Scheduling policy in plain Python: which sequences run next, and how many tokens each.

Both schedulers do O(batch) work per step and plan on top of steps still in flight: a step's
tokens count as scheduled (`num_computed_tokens`, `num_in_flight`) the moment it is scheduled.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from pdserve.engine.core.admission import can_admit, computable_prefix, shareable_blocks
from pdserve.engine.core.batch import Batch, ScheduledChunk
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import Speculator
from pdserve.engine.core.tier_plan import TierPlan

ReserveHook = Callable[[Sequence], bool]


class PrefillScheduler:
    """Priority, then arrival; long prompts run in chunks of at most `max_prefill_tokens`.

    A sequence that got a chunk goes to the back of its priority class, so a short prompt
    arriving during a long one runs between two of its chunks. A sequence is admitted when it
    fits the pool (the cached prefix shared, at most `pool_max_seqs` sequences, `watermark`) and
    `reserve` agrees (the decode side's blocks in disaggregated mode); when admission fails, no
    later arrival is admitted this step (back-pressure keeps arrival order), but sequences
    already admitted keep getting chunks. A sequence whose last chunk is scheduled leaves. With KV tiers
    (`tiers`), the blocks after its cached prefix that a tier holds are loaded, and it gets no chunk until
    they have been (`Sequence.loading`).
    """

    def __init__(self, blocks: BlockManager, max_prefill_tokens: int, max_num_seqs: int,
                 reserve: ReserveHook | None = None, pool_max_seqs: int | None = None,
                 watermark: float = 1.0) -> None:
        self.blocks = blocks
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_seqs = max_num_seqs
        self.reserve = reserve
        self.pool_max_seqs = pool_max_seqs
        self.watermark = watermark
        self._waiting: list[tuple[int, int, Sequence]] = []    # not admitted yet
        self._running: list[tuple[int, int, Sequence]] = []    # admitted, more chunks to go
        self._queued: dict[str, Sequence] = {}                 # NOTE: heap entries not in here are stale
        self._turn = itertools.count()
        self.tiers: TierPlan | None = None

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, seq: Sequence) -> None:
        self._queued[seq.request_id] = seq
        heapq.heappush(self._waiting, (-seq.priority, next(self._turn), seq))

    def sequences(self) -> Iterator[Sequence]:
        return iter(list(self._queued.values()))

    def in_order(self) -> list[Sequence]:
        """The queued sequences in the order `schedule` takes them (priority, then turn)."""
        live = [entry for entry in (*self._running, *self._waiting)
                if self._queued.get(entry[2].request_id) is entry[2]]
        return [entry[2] for entry in sorted(live, key=lambda entry: entry[:2])]

    def schedule(self, token_budget: int | None = None) -> tuple[ScheduledChunk, ...]:
        budget = self.max_prefill_tokens if token_budget is None else token_budget
        chunks, requeue, admitting = [], [], True
        while budget > 0 and len(chunks) < self.max_num_seqs:
            heap = self._next_heap(admitting)
            if heap is None:
                break
            entry = heapq.heappop(heap)
            seq = entry[2]
            if heap is self._waiting and not self._admit(seq):
                heapq.heappush(heap, entry)                      # NOTE: keeps its place in line
                admitting = False
                continue
            if seq.loading:
                requeue.append(seq)
                continue
            chunk = self._take_chunk(seq, budget)
            chunks.append(chunk)
            budget -= chunk.num_tokens
            if chunk.sample:
                self.remove(seq)
            else:
                requeue.append(seq)
        for seq in requeue:
            heapq.heappush(self._running, (-seq.priority, next(self._turn), seq))
        return tuple(chunks)

    def _next_heap(self, admitting: bool) -> list | None:
        """The heap whose first live entry comes next (waiting ones only while admitting)."""
        heaps = [h for h in ((self._running, self._waiting) if admitting else (self._running,)) if self._top(h)]
        return min(heaps, key=lambda h: h[0][:2], default=None)

    def _top(self, heap: list) -> bool:
        while heap and self._queued.get(heap[0][2].request_id) is not heap[0][2]:
            heapq.heappop(heap)
        return bool(heap)

    @staticmethod
    def _take_chunk(seq: Sequence, budget: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        size = min(seq.num_tokens - start, budget)
        chunk = ScheduledChunk(seq, start, size, sample=start + size == seq.num_tokens)
        seq.num_computed_tokens += size
        seq.num_in_flight += chunk.sample
        return chunk

    def _admit(self, seq: Sequence) -> bool:
        """Take blocks for `seq` (its cached prefix shared): its KV starts after the prefix."""
        blocks, size = self.blocks, self.blocks.block_size
        hits = computable_prefix(blocks, seq)
        if not can_admit(blocks, seq.request_id, seq.num_tokens + 1, self.pool_max_seqs, self.watermark, hits):
            return False
        if self.reserve is not None and not self.reserve(seq):
            return False
        seq.block_table = blocks.grow(seq.request_id, seq.num_tokens, prefix=hits)
        seq.state_slot = blocks.state_slot(seq.request_id)
        loaded = self.tiers.load_prefix(seq, len(hits), shareable_blocks(seq, size)) if self.tiers else 0
        seq.num_computed_tokens = seq.num_cached_tokens = (len(hits) + loaded) * size
        seq.num_registered_blocks = len(hits)
        blocks.count_lookup(seq.num_tokens, len(hits) * size)
        return True

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (prefilled, aborted or failed). Its blocks are the caller's to free."""
        if self._queued.get(seq.request_id) is seq:
            del self._queued[seq.request_id]

    def find(self, request_id: str) -> Sequence | None:
        return self._queued.get(request_id)


class DecodeScheduler:
    """Continuous batching: one token per running sequence per step, round robin within a priority.

    When blocks run out, the lowest-priority, newest sequence is preempted: it leaves the
    scheduler and `on_preempt` frees its blocks and sends it back to be prefilled again. Blocks
    that a step in flight still holds (`BlockManager.num_deferred`) count as coming: a sequence
    that can wait for them waits a step instead of preempting another.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, on_preempt: Callable[[Sequence], None],
                 max_model_len: int = 1 << 62, speculator: Speculator | None = None) -> None:
        self.blocks = blocks
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.on_preempt = on_preempt
        self._queues: dict[int, dict[Sequence, None]] = {}     # priority -> round-robin order
        self._by_id: dict[str, Sequence] = {}
        self._admitted_at: dict[Sequence, int] = {}
        self._clock = itertools.count()
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def running(self) -> list[Sequence]:
        return list(self._by_id.values())

    def add(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.priority, {})[seq] = None
        self._by_id[seq.request_id] = seq
        self._admitted_at[seq] = next(self._clock)

    def schedule(self, prefill_tokens: int = 0) -> tuple[Sequence, ...]:
        """The sequences that decode this step (each gets one position and one in-flight token, and
        drafts to verify where they pay next to `prefill_tokens` prefill tokens)."""
        chosen = self.choose()
        self.draft(chosen, prefill_tokens)
        return chosen

    def choose(self) -> tuple[Sequence, ...]:
        """The sequences that decode this step, without drafts yet (`draft` adds them)."""
        chosen: list[Sequence] = []
        for priority in sorted(self._queues, reverse=True):
            room = self.max_num_seqs - len(chosen)
            if room <= 0:
                break
            for seq in self._take_turns(self._queues.get(priority, {}), room):
                if (not seq.done and not seq.drafts and seq.can_continue(self.max_model_len)
                        and self._make_room(seq)):
                    chosen.append(seq)
        chosen = [seq for seq in chosen if not seq.done]      # NOTE: a later one's room may preempt it
        for seq in chosen:
            seq.num_computed_tokens += 1
            seq.num_in_flight += 1
        return tuple(chosen)

    def draft(self, chosen: tuple[Sequence, ...], prefill_tokens: int = 0) -> None:
        """Drafts for the chosen sequences with nothing else in flight, as many as the step's cost allows."""
        if self.speculator is None:
            return
        seqs = [seq for seq in chosen if seq.num_in_flight == 1]
        rooms = [self._room(seq) for seq in seqs]
        lengths = self.speculator.plan(seqs, rooms, len(chosen), prefill_tokens)
        if lengths is None:
            return
        drafting = [(seq, room, allotted) for seq, room, allotted in zip(seqs, rooms, lengths) if room > 0]
        proposals = self.speculator.draft_rows(*zip(*drafting)) if drafting else ()
        for (seq, _, _), drafts in zip(drafting, proposals):
            self._place(seq, drafts)

    def _room(self, seq: Sequence) -> int:
        """Drafts `seq` may take: as many as max_tokens and the context allow, past its next token."""
        return min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1

    def _place(self, seq: Sequence, drafts: tuple[int, ...]) -> None:
        """Give `seq` its `drafts` to verify this step, as many as free blocks allow."""
        if not drafts:
            return
        held = len(seq.block_table) * self.blocks.block_size
        fits = held - seq.num_computed_tokens + self.blocks.num_free * self.blocks.block_size
        drafts = drafts[:max(fits, 0)]                        # NOTE: drafts never preempt anyone
        if drafts:
            seq.block_table = self.blocks.grow(seq.request_id, seq.num_computed_tokens + len(drafts))
            seq.drafts = drafts
            seq.num_computed_tokens += len(drafts)

    @staticmethod
    def _take_turns(queue: dict[Sequence, None], room: int) -> list[Sequence]:
        if len(queue) <= room:
            return list(queue)
        taken = list(itertools.islice(queue, room))
        for seq in taken:                                     # to the back of the line
            del queue[seq]
            queue[seq] = None
        return taken

    def _make_room(self, seq: Sequence) -> bool:
        if seq.num_computed_tokens < len(seq.block_table) * self.blocks.block_size:
            return True                                       # its next position is in a block it holds
        needed = self.blocks.blocks_needed(seq.request_id, seq.num_computed_tokens + 1)
        while needed > self.blocks.num_free:
            if needed <= self.blocks.num_free + self.blocks.num_deferred:
                return False                                  # room arrives when the step in flight ends
            victim = min(self._by_id.values(), key=lambda s: (s.priority, -self._admitted_at[s]))
            self.preempt(victim)
            if victim is seq:
                return False
        seq.block_table = self.blocks.grow(seq.request_id, seq.num_computed_tokens + 1)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._forget(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.on_preempt(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (its output joins the speculator's cache). Its blocks are the caller's to free."""
        if self._by_id.get(seq.request_id) is seq:
            self._forget(seq)
            if self.speculator is not None:
                self.speculator.retire(seq)

    def _forget(self, seq: Sequence) -> None:
        del self._by_id[seq.request_id]
        del self._admitted_at[seq]
        queue = self._queues[seq.priority]
        del queue[seq]
        if not queue:
            del self._queues[seq.priority]

    def find(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)


def mixed_batch(decode: DecodeScheduler, prefill: PrefillScheduler,
                prefill_budget: Callable[[int], int]) -> Batch | None:
    """One step on one pool: every running sequence decodes, then prefill chunks of up to
    `prefill_budget(decode rows)` tokens. A sequence whose last chunk is scheduled joins the decode
    side at once (it decodes from the next step)."""
    running = decode.choose()
    chunks = prefill.schedule(prefill_budget(len(running)))
    decode.draft(running, sum(c.num_tokens for c in chunks))
    for chunk in chunks:
        if chunk.sample:
            decode.add(chunk.seq)
    return Batch.of(running, chunks) if running or chunks else None
