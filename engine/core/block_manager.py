"""Paged KV bookkeeping in pure integers: free list, reference counts, block tables, prefix cache."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.engine.core.state_slots import StateSlots
from pdserve.engine.core.window_slots import WindowSlotPool, WindowSlots, WindowTables


NO_BLOCK = -1          # a table entry whose block went back to the pool: behind the KV window, never read again


class NoFreeBlocks(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the block ids of one KV pool. Never touches tensors.

    Invariant: every block id is either on the free list (ref count 0) or held by one or more
    sequences' tables (ref count = number of holders), a table released with `free_after`
    counting as a holder until its fence is released.

    Prefix cache (`enable_caching`): a full block whose KV is computed can be registered under
    its hash; a new sequence takes the longest run of registered blocks matching its own hashes
    (sharing them: ref count + 1). A registered block keeps its hash on the free list, which is
    least-recently-used first: it stays reusable until it is handed out for new tokens.

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
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_window = kv_window
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # first out first
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._deferred: dict[int, list[list[int]]] = {}     # fence -> tables released once it passes
        self._deferred_slots: dict[int, list[int]] = {}     # fence -> state slots released with them
        self.num_deferred = 0
        self._cached: dict[bytes, int] = {}                 # hash -> block
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self.prefix_queries = 0                             # tokens looked up at admission
        self.prefix_hits = 0                                # of which found in the cache
        self.evicted: list[tuple[int, bytes]] | None = None   # (block, hash) of registered blocks handed out
        #                                                     again, while a KV tier wants them (else None)
        self.state_slots = state_slots
        self._free_slots = list(range(state_slots.count - 1, -1, -1)) if state_slots else []
        self._slot_of: dict[str, int] = {}
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
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block, hash) of every block the prefix cache holds, in the order they were registered."""
        return [(block, digest) for digest, block in self._cached.items()]

    def usage_after(self, extra_blocks: int) -> float:
        return (self.num_used + extra_blocks) / max(self.num_blocks, 1)

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
        start = self.windows.first_block(len(prefix) * self.block_size if window_from is None else window_from)
        needed = self.windows.needed(self._tables.get(seq_id), blocks_for(num_tokens, self.block_size), prefix, start)
        return needed > self.windows.pool.available

    def lacks_state_slot(self, seq_id: str) -> bool:
        """A new table here needs a state slot and none is free."""
        return self.state_slots is not None and seq_id not in self._tables and not self._free_slots

    def state_slot(self, seq_id: str) -> int:
        """The state slot of `seq_id`'s table (-1 without state slots)."""
        return self._slot_of.get(seq_id, -1)

    def state_blocks(self, seq_id: str) -> tuple[int, ...]:
        """The blocks of `seq_id`'s state slot (none without state slots)."""
        slot = self._slot_of.get(seq_id)
        return () if slot is None else self.state_slots.blocks(slot)

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

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
        if self.state_slots is not None and seq_id not in self._tables:
            self._slot_of[seq_id] = self._free_slots.pop()
        table = self._tables.setdefault(seq_id, [])
        table.extend([NO_BLOCK] * first_block)               # NOTE: cached blocks behind the window stay free
        for block in prefix[first_block:]:
            self._share(block)
            table.append(block)
        while len(table) < blocks_for(num_tokens, self.block_size):
            table.append(self._take_free())
        if self.windows:
            position = len(prefix) * self.block_size if window_from is None else window_from
            self.windows.extend(seq_id, table, old_len, self.windows.first_block(position))
        return table

    def _share(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        stale = self._hash_of[block]
        if stale is not None:                                # evicted: its KV is about to be overwritten
            del self._cached[stale]
            self._hash_of[block] = None
            if self.evicted is not None:
                self.evicted.append((block, stale))
        self._ref_counts[block] = 1
        if self.windows:
            self.windows.pool.drop(block)
        return block

    # prefix cache
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (block i holds hash i)."""
        if not self.enable_caching:
            return []
        hits = []
        for digest in hashes:
            block = self._cached.get(digest)
            if block is None:
                break
            hits.append(block)
        return self.windows.usable(hits) if self.windows else hits

    def window_blocks(self, seq_id: str) -> tuple[tuple[int, ...], ...]:
        """For each block of `seq_id`'s table, the pool blocks of its window slot (none: behind the window)."""
        pool = self.windows.pool if self.windows else None
        return tuple(pool.slots.blocks(pool.slot_of[block]) if pool and block != NO_BLOCK and
                     pool.slot_of[block] >= 0 else () for block in self._tables[seq_id])

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

    def take_evicted(self, since: int = 0) -> list[tuple[int, bytes]]:
        """The evicted (block, hash) pairs reported since the `since`-th one, no longer reported."""
        if not self.evicted:
            return []
        taken = self.evicted[since:]
        del self.evicted[since:]
        return taken

    def count_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += hit_tokens

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
        if self.windows:
            self.windows.close(seq_id, table)
        self._free_slot(self._slot_of.pop(seq_id, None))
        return self._release(table)

    def _free_slot(self, slot: int | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)

    def free_after(self, seq_id: str, fence: int) -> int:
        """Like `free`, but the blocks return to the free list only at `release_through(fence)`.

        For blocks that a step still in flight may write: they must not be handed out before it ends.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        if self.windows:
            self.windows.close(seq_id, table, fence)
        table = [block for block in table if block != NO_BLOCK]
        self._deferred.setdefault(fence, []).append(table)
        self.num_deferred += len(table)
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self._deferred_slots.setdefault(fence, []).append(slot)
        return len(table)

    def release_through(self, fence: int) -> int:
        """Free the tables deferred to fences up to `fence`; returns the number of blocks released."""
        released = 0
        if self.windows:
            self.windows.release_through(fence)
        for passed in [f for f in self._deferred if f <= fence]:
            for table in self._deferred.pop(passed):
                released += self._release(table)
            for slot in self._deferred_slots.pop(passed, ()):
                self._free_slot(slot)
        self.num_deferred -= released
        return released

    def _release(self, table: list[int]) -> int:
        released = 0
        for block in reversed(table):                        # NOTE: a table's tail is evicted before its head
            if block == NO_BLOCK:
                continue
            released += 1
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:             # nothing worth keeping: handed out first
                    self._free.move_to_end(block, last=False)
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
        for block in range(self.num_blocks):
            assert self._ref_counts[block] == held.get(block, 0), f"block {block} ref count"
            assert (block in held) != (block in self._free), f"block {block} both free and held"
        for digest, block in self._cached.items():
            assert self._hash_of[block] == digest, f"block {block} hash map"
        if self.state_slots is not None:
            held_slots = [*self._slot_of.values(), *(s for slots in self._deferred_slots.values() for s in slots)]
            assert set(self._slot_of) == set(self._tables), "a table without its state slot"
            assert sorted(held_slots + self._free_slots) == list(range(self.state_slots.count)), "state slots"
        if self.windows:
            self.windows.check(self._tables)
