"""Paged KV bookkeeping in pure integers: block tables over a pool (`BlockPool`), state and window slots."""
from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.core.block_pool import NO_BLOCK, BlockPool, NoFreeBlocks, blocks_for
from pdserve.engine.core.state_slots import StateSlots, StateSlotTable
from pdserve.engine.core.window_slots import WindowSlotPool, WindowSlots, WindowTables

__all__ = ["NO_BLOCK", "BlockManager", "BlockPool", "NoFreeBlocks", "blocks_for"]


class BlockManager(BlockPool):
    """Owns the block ids of one KV pool. Never touches tensors.

    Its pool (`BlockPool`): a table released with `free_after` counts as a holder until its fence is released.

    State slots (`state_slots`, a model with recurrent layers): a new table takes a free slot and gives it back
    when it is freed (or its fence passes), so a slot is held exactly as long as the table.

    KV window (`kv_window`, every attention layer slides with it): a block wholly behind the window of the next
    position to compute goes back (`release_behind`, a table entry becomes NO_BLOCK), and a table may start with
    NO_BLOCK entries where its KV is needed only from a later block on (`grow`'s `first_block`): a table is always
    a run of NO_BLOCK, then blocks.

    Window slots (`window_slots`, a model mixing one window with full layers): a table's blocks inside its window
    also hold a slot for the sliding layers' K and V (`engine.core.window_slots`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 state_slots: StateSlots | None = None, kv_window: int = 0,
                 window_slots: WindowSlots | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.kv_window = kv_window
        self._tables: dict[str, list[int]] = {}
        self._deferred: dict[int, list[list[int]]] = {}     # fence -> tables released once it passes
        self.num_deferred = 0
        self.state_slots = state_slots
        self.states = state_slots and StateSlotTable(state_slots)
        self.windows = window_slots and WindowTables(WindowSlotPool(window_slots, num_blocks), block_size,
                                                     lambda block: self._hash_of[block] is not None)

    @property
    def num_free(self) -> int:
        """Blocks a table may take now (each one inside a window needs a window slot too)."""
        return min(len(self._free), self.windows.pool.available) if self.windows else len(self._free)

    @property
    def releases_behind(self) -> bool:
        """Whether a table gives back what lies behind a window as it advances (`release_behind`)."""
        return bool(self.kv_window or self.windows)

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def blocks_needed(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (), first_block: int = 0) -> int:
        """Free blocks that growing `seq_id` to `num_tokens` tokens takes (sharing `prefix` first; a new table
        holds nothing before `first_block`)."""
        held = len(self._tables.get(seq_id, ())) or max(len(prefix), first_block)
        idle_hits = sum(1 for block in prefix[first_block:] if self._ref_counts[block] == 0)
        return max(blocks_for(num_tokens, self.block_size) - held, 0) + idle_hits

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block that computing position `num_tokens` (or a later one) reads: 0 without a KV window."""
        if not self.kv_window:
            return 0
        return max(num_tokens + 1 - self.kv_window, 0) // self.block_size

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return (self.blocks_needed(seq_id, num_tokens) <= self.num_free and not self.lacks_state_slot(seq_id)
                and not self.lacks_window_slots(seq_id, num_tokens))

    def lacks_window_slots(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (),
                           window_from: int | None = None) -> bool:
        """Growing `seq_id` (a new table: from the cached `prefix`, computing from position `window_from`) to
        `num_tokens` tokens needs more window slots than are available."""
        if not self.windows:
            return False
        needed = self.windows.needed(self._tables.get(seq_id), blocks_for(num_tokens, self.block_size), prefix,
                                     self._window_start(prefix, window_from))
        return needed > self.windows.pool.available

    def _window_start(self, prefix: Sequence[int], window_from: int | None) -> int:
        """The first block a new table's window holds: that of position `window_from`, by default the prefix's end."""
        return self.windows.first_block(len(prefix) * self.block_size if window_from is None else window_from)

    def lacks_state_slot(self, seq_id: str) -> bool:
        """A new table here needs a state slot and none is free."""
        return bool(self.states) and self.states.lacks(seq_id)

    def state_slot(self, seq_id: str) -> int:
        """The state slot of `seq_id`'s table (-1 without state slots)."""
        return self.states.slot(seq_id) if self.states else -1

    def state_blocks(self, seq_id: str) -> tuple[int, ...]:
        """The blocks of `seq_id`'s state slot (none without state slots)."""
        return self.states.blocks(seq_id) if self.states else ()

    @property
    def num_free_state_slots(self) -> int:
        return self.states.num_free if self.states else 0

    def grow(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (), first_block: int = 0,
             window_from: int | None = None) -> list[int]:
        """Extend (or create) the table of `seq_id` to cover `num_tokens` tokens; returns the table.

        A new table starts with the cached blocks `prefix` (from `match`), NO_BLOCK before `first_block` (KV
        nobody will read: behind the window); its window slots from the block of position `window_from` (default:
        the first after the prefix). Raises NoFreeBlocks, changing nothing, when there are not enough free blocks.
        """
        if seq_id in self._tables:
            prefix, first_block = (), 0
        needed = self.blocks_needed(seq_id, num_tokens, prefix, first_block)
        if needed > len(self._free):
            raise NoFreeBlocks(f"need {needed} blocks, {len(self._free)} free")
        if self.lacks_window_slots(seq_id, num_tokens, prefix, window_from):
            raise NoFreeBlocks(f"no window slots for {num_tokens} tokens: {self.windows.pool.available} available")
        old_len = len(self._tables.get(seq_id, ()))
        if self.lacks_state_slot(seq_id):
            raise NoFreeBlocks(f"no free state slot of {self.state_slots.count}")
        if self.states:
            self.states.take(seq_id)
        table = self._tables.setdefault(seq_id, [])
        table.extend([NO_BLOCK] * first_block)               # NOTE: cached blocks behind the window stay free
        for block in prefix[first_block:]:
            self._share(block)
            table.append(block)
        while len(table) < blocks_for(num_tokens, self.block_size):
            table.append(self._take_free())
        if self.windows:
            self.windows.extend(seq_id, table, old_len, self._window_start(prefix, window_from))
        return table

    def _take_free(self) -> int:
        block = super()._take_free()
        if self.windows:
            self.windows.pool.drop(block)                    # NOTE: its kept window slot is stale now
        return block

    # prefix cache
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (block i holds hash i)."""
        hits = self._cached_run(hashes)
        return self.windows.usable(hits) if self.windows else hits

    def window_blocks(self, seq_id: str, first: int = 0, last: int | None = None) -> tuple[tuple[int, ...], ...]:
        """For each block `first` .. `last` - 1 of `seq_id`'s table, the pool blocks of its window slot (none:
        behind the window)."""
        pool = self.windows.pool if self.windows else None
        return tuple(pool.slots.blocks(pool.slot_of[block]) if pool and block != NO_BLOCK and
                     pool.slot_of[block] >= 0 else () for block in self._tables[seq_id][first:last])

    def take_window_assignments(self) -> tuple[tuple[int, int], ...]:
        """The (block, window slot) pairs given out since the last call, for the runner."""
        return self.windows.pool.take_assigned() if self.windows else ()

    def register(self, seq_id: str, hashes: Sequence[bytes], start: int = 0) -> None:
        """Register blocks start .. len(hashes) - 1 of `seq_id`'s table (full, KV computed) under `hashes`."""
        if not self.enable_caching:
            return
        table = self._tables.get(seq_id)
        if table is None:
            return
        for index in range(start, min(len(hashes), len(table))):
            block, digest = table[index], hashes[index]
            if block != NO_BLOCK and self._hash_of[block] is None and digest not in self._cached:
                self._cached[digest] = block
                self._hash_of[block] = digest

    # release
    def release_behind(self, seq_id: str, num_tokens: int) -> int:
        """Release the blocks of `seq_id` that computing position `num_tokens` or a later one never reads (none
        without a KV window). Returns the number released."""
        table = self._tables.get(seq_id)
        if table is not None and self.windows:
            return self.windows.pass_to(seq_id, table, min(self.windows.first_block(num_tokens), len(table)))
        if table is None or not self.kv_window:
            return 0
        stop = min(self.first_needed_block(num_tokens), len(table))
        first = stop
        while first > 0 and table[first - 1] != NO_BLOCK:      # NOTE: only the newly passed blocks are walked
            first -= 1
        behind = table[first:stop]
        table[first:stop] = [NO_BLOCK] * (stop - first)
        return self._release(behind)

    def truncate(self, seq_id: str, num_tokens: int) -> int:
        """Release the blocks of `seq_id` past those covering `num_tokens` tokens (no step may still use
        them: rejected draft positions). Returns the number released."""
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        keep = blocks_for(num_tokens, self.block_size)
        if self.windows:
            self.windows.trim(seq_id, table, keep)
        tail = table[keep:]
        del table[keep:]
        return self._release(tail)

    def free(self, seq_id: str) -> int:
        """Release every block of `seq_id` (and its state slot); a second call is a no-op. Returns the number
        released."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._close(seq_id, table)
        return self._release(table)

    def _close(self, seq_id: str, table: list[int], fence: int | None = None) -> None:
        """`seq_id`'s table is gone: its window and state slots go back, at once or once `fence` passes."""
        if self.windows:
            self.windows.close(seq_id, table, fence)
        if self.states:
            self.states.close(seq_id, fence)

    def free_after(self, seq_id: str, fence: int) -> int:
        """Like `free`, but the blocks return to the free list only at `release_through(fence)`.

        For blocks that a step still in flight may write: they must not be handed out before it ends.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._close(seq_id, table, fence)
        table = [block for block in table if block != NO_BLOCK]
        self._deferred.setdefault(fence, []).append(table)
        self.num_deferred += len(table)
        return len(table)

    def release_through(self, fence: int) -> int:
        """Free the tables deferred to fences up to `fence`; returns the number of blocks released."""
        released = 0
        if self.windows:
            self.windows.release_through(fence)
        if self.states:
            self.states.release_through(fence)
        for passed in [f for f in self._deferred if f <= fence]:
            for table in self._deferred.pop(passed):
                released += self._release(table)
        self.num_deferred -= released
        return released

    def check_consistency(self) -> None:
        """Raise AssertionError if the accounting is off (used by tests)."""
        held: dict[int, int] = {}
        deferred = [table for tables in self._deferred.values() for table in tables]
        assert self.num_deferred == sum(len(t) for t in deferred), "deferred count"
        for table in [*self._tables.values(), *deferred]:
            for block in table:
                if block != NO_BLOCK:
                    held[block] = held.get(block, 0) + 1
        self._check_pool(held)
        if self.states:
            self.states.check(self._tables)
        if self.windows:
            self.windows.check(self._tables)
