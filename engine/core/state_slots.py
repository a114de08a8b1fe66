"""Where a model with recurrent layers keeps each sequence's state in its unit's pool."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StateSlots:
    """A model with recurrent layers keeps each sequence's state in a slot: `count` slots of `blocks_per_slot`
    consecutive blocks each, after the pool's KV blocks (slot i starts at block first_block + i * blocks_per_slot),
    so a slot is copied as one run of blocks."""

    count: int
    blocks_per_slot: int
    first_block: int

    def blocks(self, slot: int) -> tuple[int, ...]:
        first = self.first_block + slot * self.blocks_per_slot
        return tuple(range(first, first + self.blocks_per_slot))


class StateSlotTable:
    """Which table holds which state slot: a new table takes a free slot and gives it back when it is freed (or
    its fence passes), so a slot is held exactly as long as the table (BlockManager's)."""

    def __init__(self, slots: StateSlots) -> None:
        self.slots = slots
        self._free = list(range(slots.count - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self._deferred: dict[int, list[int]] = {}           # fence -> slots released once it passes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lacks(self, seq_id: str) -> bool:
        """A new table for `seq_id` needs a slot and none is free."""
        return seq_id not in self._slot_of and not self._free

    def take(self, seq_id: str) -> None:
        if seq_id not in self._slot_of:
            self._slot_of[seq_id] = self._free.pop()

    def slot(self, seq_id: str) -> int:
        return self._slot_of.get(seq_id, -1)

    def blocks(self, seq_id: str) -> tuple[int, ...]:
        slot = self._slot_of.get(seq_id)
        return () if slot is None else self.slots.blocks(slot)

    def close(self, seq_id: str, fence: int | None = None) -> None:
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None and fence is None:
            self._free.append(slot)
        elif slot is not None:
            self._deferred.setdefault(fence, []).append(slot)

    def release_through(self, fence: int) -> None:
        for passed in [f for f in self._deferred if f <= fence]:
            self._free += self._deferred.pop(passed)

    def check(self, tables) -> None:
        held = [*self._slot_of.values(), *(s for slots in self._deferred.values() for s in slots)]
        assert set(self._slot_of) == set(tables), "a table without its state slot"
        assert sorted(held + self._free) == list(range(self.slots.count)), "state slots"
