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
