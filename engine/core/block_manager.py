"""Paged KV bookkeeping in pure integers: free list, reference counts, per-sequence block tables."""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the block ids of one KV pool. Never touches tensors.

    Invariant: every block id is either on the free list (ref count 0) or held
    by one or more sequences' tables (ref count = number of holders), a table
    released with `free_after` counting as a holder until its fence is released.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._deferred: dict[int, list[list[int]]] = {}     # fence -> tables released once it passes
        self.num_deferred = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage_after(self, extra_blocks: int) -> float:
        return (self.num_used + extra_blocks) / max(self.num_blocks, 1)

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so that `seq_id` can hold `num_tokens` tokens."""
        held = len(self._tables.get(seq_id, ()))
        return max(blocks_for(num_tokens, self.block_size) - held, 0)

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free

    def grow(self, seq_id: str, num_tokens: int) -> list[int]:
        """Extend (or create) the table of `seq_id` to cover `num_tokens` tokens; returns the table.

        Raises NoFreeBlocks, changing nothing, when there are not enough free blocks.
        """
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise NoFreeBlocks(f"need {needed} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
        return table

    def free(self, seq_id: str) -> int:
        """Release every block of `seq_id`; a second call is a no-op. Returns the number released."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        return self._release(table)

    def free_after(self, seq_id: str, fence: int) -> int:
        """Like `free`, but the blocks return to the free list only at `release_through(fence)`.

        For blocks that a step still in flight may write: they must not be handed out before it ends.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._deferred.setdefault(fence, []).append(table)
        self.num_deferred += len(table)
        return len(table)

    def release_through(self, fence: int) -> int:
        """Free the tables deferred to fences up to `fence`; returns the number of blocks released."""
        released = 0
        for passed in [f for f in self._deferred if f <= fence]:
            for table in self._deferred.pop(passed):
                released += self._release(table)
        self.num_deferred -= released
        return released

    def _release(self, table: list[int]) -> int:
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.appendleft(block)
        return len(table)

    def check_consistency(self) -> None:
        """Raise AssertionError if the accounting is off (used by tests)."""
        held: dict[int, int] = {}
        deferred = [table for tables in self._deferred.values() for table in tables]
        assert self.num_deferred == sum(len(t) for t in deferred), "deferred count"
        for table in [*self._tables.values(), *deferred]:
            for block in table:
                held[block] = held.get(block, 0) + 1
        free = set(self._free)
        assert len(free) == len(self._free), "free list has duplicates"
        for block in range(self.num_blocks):
            assert self._ref_counts[block] == held.get(block, 0), f"block {block} ref count"
            assert (block in held) != (block in free), f"block {block} both free and held"
