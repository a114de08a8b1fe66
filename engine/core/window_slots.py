"""The sliding layers' K and V of a model that mixes one window with full-attention layers, kept for the window only.

The pool's blocks hold the full layers' K and V; a block inside some sequence's window also holds a window slot (the
sliding layers' K and V of its tokens), carved from the end of the pool like the recurrent state slots, so every
transport moves a slot as one more run of blocks. A slot belongs to its block: it is taken when a table takes the
block inside its window, let go when every table holding it has passed it, and kept (evictable, least recently used
first) while the block stays in the prefix cache, so a cached prefix is usable while its last window still has slots.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

NO_SLOT = -1


@dataclass(frozen=True, slots=True)
class WindowSlots:
    """`count` slots of `blocks_per_slot` consecutive pool blocks each (slot i starts at block first_block + i *
    blocks_per_slot) for the sliding layers of `window` tokens."""

    count: int
    blocks_per_slot: int
    first_block: int
    window: int

    def blocks(self, slot: int) -> tuple[int, ...]:
        first = self.first_block + slot * self.blocks_per_slot
        return tuple(range(first, first + self.blocks_per_slot))


class WindowSlotPool:
    """Which block holds which window slot, in pure integers (BlockManager's)."""

    def __init__(self, slots: WindowSlots, num_blocks: int) -> None:
        self.slots = slots
        self.slot_of = [NO_SLOT] * num_blocks
        self._holders = [0] * num_blocks                    # tables holding the block inside their window
        self._free = list(range(slots.count - 1, -1, -1))
        self._kept: OrderedDict[int, None] = OrderedDict()   # blocks with a slot and no holder (prefix cache)
        self.assigned: list[tuple[int, int]] = []            # (block, slot) since the runner last heard

    @property
    def available(self) -> int:
        return len(self._free) + len(self._kept)

    @property
    def num_held(self) -> int:
        return self.slots.count - self.available

    def unheld(self, block: int) -> bool:
        return self._holders[block] == 0

    def covers(self, blocks: Iterable[int]) -> bool:
        return all(self.slot_of[block] != NO_SLOT for block in blocks)

    def hold(self, block: int) -> None:
        """A table takes `block` inside its window: it gets a slot (a free one, else the least recently kept)."""
        if self._holders[block] == 0:
            if self.slot_of[block] == NO_SLOT:
                self.slot_of[block] = self._take()
                self.assigned.append((block, self.slot_of[block]))
            else:
                self._kept.pop(block, None)
        self._holders[block] += 1

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._kept.popitem(last=False)            # NOTE: raises KeyError when none is left
        slot, self.slot_of[block] = self.slot_of[block], NO_SLOT
        return slot

    def let_go(self, block: int, keep: bool) -> None:
        """A table passes `block` (or lets it go): with no holder left its slot is kept (`keep`: the block is
        cached) or freed."""
        self._holders[block] -= 1
        if self._holders[block] == 0:
            if keep:
                self._kept[block] = None
            else:
                self.drop(block)

    def drop(self, block: int) -> None:
        """`block`'s K and V are about to be overwritten (handed out again): a kept slot goes back."""
        if self._holders[block] == 0 and self.slot_of[block] != NO_SLOT:
            self._kept.pop(block, None)
            self._free.append(self.slot_of[block])
            self.slot_of[block] = NO_SLOT

    def take_assigned(self) -> tuple[tuple[int, int], ...]:
        taken, self.assigned = tuple(self.assigned), []
        return taken

    def check(self, holders: dict[int, int]) -> None:
        """Raise AssertionError unless `holders` (block -> tables holding it inside their window) matches."""
        for block, count in enumerate(self._holders):
            assert count == holders.get(block, 0), f"block {block} window holders"
            assert not count or self.slot_of[block] != NO_SLOT, f"block {block} held without a window slot"
            assert (block in self._kept) == (not count and self.slot_of[block] != NO_SLOT), f"block {block} kept"
        attached = [slot for slot in self.slot_of if slot != NO_SLOT]
        assert sorted(attached + self._free) == list(range(self.slots.count)), "window slots"


class WindowTables:
    """Which of each table's blocks lie inside its window (from `start[seq]` on), holding their slots in `pool`.

    `keep(block)` says whether a block let go keeps its slot (it is in the prefix cache)."""

    def __init__(self, pool: WindowSlotPool, block_size: int, keep) -> None:
        self.pool, self.block_size, self.keep = pool, block_size, keep
        self.window = pool.slots.window
        self.start: dict[str, int] = {}
        self._deferred: dict[int, list[list[int]]] = {}     # fence -> blocks let go once it passes

    def first_block(self, num_tokens: int) -> int:
        """The first block that computing position `num_tokens` (or a later one) reads in a sliding layer."""
        return max(num_tokens + 1 - self.window, 0) // self.block_size

    def usable(self, hits: list[int]) -> list[int]:
        """The longest prefix of the cached `hits` whose last window still has slots (computing from its end reads
        them in the sliding layers)."""
        n = len(hits)
        while n and not self.pool.covers(hits[self.first_block(n * self.block_size):n]):
            n -= 1
        return hits[:n]

    def needed(self, table: list[int] | None, num_blocks: int, prefix, start: int) -> int:
        """Slots growing `table` (None: a new one from the cached `prefix`, its window from block `start`) to
        `num_blocks` blocks takes from the available ones."""
        if table is not None:
            return max(num_blocks - len(table), 0)
        idle = sum(1 for block in prefix[start:] if self.pool.unheld(block))
        return idle + max(num_blocks - max(len(prefix), start), 0)

    def extend(self, seq_id: str, table: list[int], old_len: int, start: int) -> None:
        """`table` grew from `old_len` blocks (0: new, its window from block `start`): its blocks inside the
        window take their slots."""
        if not old_len:
            self.start[seq_id] = start
        for block in table[max(old_len, self.start[seq_id]):]:
            self.pool.hold(block)

    def pass_to(self, seq_id: str, table: list[int], stop: int) -> int:
        """Let go the slots of `table`'s blocks before `stop` (behind its window now); returns how many."""
        first = self.start[seq_id]
        self._let_go(table[first:stop])
        self.start[seq_id] = max(first, stop)
        return max(stop - first, 0)

    def close(self, seq_id: str, table: list[int], fence: int | None = None) -> None:
        """`table` is freed: it lets go of its blocks inside the window, at once or once `fence` passes."""
        inside = table[self.start.pop(seq_id):]
        if fence is None:
            self._let_go(inside)
        else:
            self._deferred.setdefault(fence, []).append(inside)

    def trim(self, seq_id: str, table: list[int], keep: int) -> None:
        """`table` keeps only its first `keep` blocks: it lets go of the others."""
        self._let_go(table[max(self.start[seq_id], keep):])

    def _let_go(self, blocks: list[int]) -> None:
        for block in blocks:
            self.pool.let_go(block, self.keep(block))

    def release_through(self, fence: int) -> None:
        for passed in [f for f in self._deferred if f <= fence]:
            for blocks in self._deferred.pop(passed):
                self._let_go(blocks)

    def check(self, tables: dict[str, list[int]]) -> None:
        holders: dict[int, int] = {}
        assert set(self.start) == set(tables), "a table without its window start"
        inside = [table[self.start[seq_id]:] for seq_id, table in tables.items()]
        for blocks in [*inside, *(b for deferred in self._deferred.values() for b in deferred)]:
            for block in blocks:
                holders[block] = holders.get(block, 0) + 1
        self.pool.check(holders)
