"""Scheduling policy in plain Python: which sequences run next, and how many tokens each."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from engine.core.admission import can_admit
from engine.core.batch import Batch, ScheduledChunk
from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence

ReserveHook = Callable[[Sequence], bool]


class PrefillScheduler:
    """Priority, then arrival; long prompts run in chunks of at most `max_prefill_tokens`.

    A sequence that got a chunk goes to the back of its priority class, so a
    short prompt arriving during a long one runs between two of its chunks.
    `reserve` is asked before a sequence is first admitted (the decode side's
    blocks in disaggregated mode); when it says no, admission stops this step.
    """

    def __init__(self, blocks: BlockManager, max_prefill_tokens: int, max_num_seqs: int,
                 reserve: ReserveHook | None = None) -> None:
        self.blocks = blocks
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_seqs = max_num_seqs
        self.reserve = reserve
        self._queue: list[tuple[int, int, Sequence]] = []
        self._turn = itertools.count()
        self._admitted: set[str] = set()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._queue, (-seq.priority, next(self._turn), seq))

    def sequences(self) -> Iterator[Sequence]:
        return (seq for _, _, seq in self._queue)

    def schedule(self, token_budget: int | None = None) -> Batch | None:
        budget = self.max_prefill_tokens if token_budget is None else token_budget
        chunks, deferred = [], []
        while self._queue and budget > 0 and len(chunks) < self.max_num_seqs:
            seq = self._queue[0][2]
            if seq.request_id not in self._admitted and not self._admit(seq):
                break
            heapq.heappop(self._queue)
            size = min(seq.num_tokens - seq.num_computed_tokens, budget)
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, size,
                                   sample=seq.num_computed_tokens + size == seq.num_tokens)
            chunks.append(chunk)
            budget -= size
            if not chunk.sample:
                deferred.append(seq)
        for seq in deferred:
            self.add(seq)
        return Batch(tuple(chunks), is_decode=False) if chunks else None

    def _admit(self, seq: Sequence) -> bool:
        if not can_admit(self.blocks, seq.request_id, seq.num_tokens):
            return False
        if self.reserve is not None and not self.reserve(seq):
            return False
        seq.block_table = self.blocks.grow(seq.request_id, seq.num_tokens)
        self._admitted.add(seq.request_id)
        return True

    def advance(self, chunk: ScheduledChunk) -> None:
        chunk.seq.num_computed_tokens = chunk.stop

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (prefilled, aborted or failed). Its blocks are the caller's to free."""
        if any(entry[2] is seq for entry in self._queue):
            self._queue = [entry for entry in self._queue if entry[2] is not seq]
            heapq.heapify(self._queue)
        self._admitted.discard(seq.request_id)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.sequences() if s.request_id == request_id), None)


    def is_admitted(self, seq: Sequence) -> bool:
        return seq.request_id in self._admitted


class DecodeScheduler:
    """Continuous batching: one token per running sequence per step.

    When blocks run out, the lowest-priority, newest sequence is preempted:
    its blocks are freed and `on_preempt` sends it back to be prefilled again.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int,
                 on_preempt: Callable[[Sequence], None]) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.on_preempt = on_preempt
        self.running: list[Sequence] = []
        self._turns: dict[str, int] = {}
        self._admission: dict[str, int] = {}
        self.num_preemptions = 0
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        self.running.append(seq)
        self._turns[seq.request_id] = self._admission[seq.request_id] = next(self._clock)

    def schedule(self) -> Batch | None:
        order = sorted(self.running, key=lambda s: (-s.priority, self._turns[s.request_id]))
        chosen = []
        for seq in order[:self.max_num_seqs]:
            if seq in self.running and self._make_room(seq):
                chosen.append(seq)
        chosen = [s for s in chosen if s in self.running]
        for seq in chosen:
            self._turns[seq.request_id] = next(self._clock)
        chunks = tuple(ScheduledChunk(s, s.num_tokens - 1, 1, sample=True) for s in chosen)
        return Batch(chunks, is_decode=True) if chunks else None

    def _make_room(self, seq: Sequence) -> bool:
        while not self.blocks.can_grow(seq.request_id, seq.num_tokens):
            victim = min(self.running, key=lambda s: (s.priority, -self._admission[s.request_id]))
            self.preempt(victim)
            if victim is seq:
                return False
        seq.block_table = self.blocks.grow(seq.request_id, seq.num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.remove(seq)
        seq.num_computed_tokens = 0
        seq.block_table = []
        self.on_preempt(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._turns.pop(seq.request_id, None)
        self._admission.pop(seq.request_id, None)
        self.blocks.free(seq.request_id)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.running if s.request_id == request_id), None)
