"""One KV tier's slots, by block hash, in plain integers (the bytes live in `engine.worker.tiers`).

A slot is free, pending (a step is writing a block into it), or ready (it holds the block of one hash,
least-recently-used first). Loads pin a ready slot until the step that reads it has ended, so no save
overwrites it meanwhile; a full tier makes room by evicting its least-recently-used unpinned slot.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class TierIndex:
    """The slots of one tier (`name`: host or disk); never touches bytes."""

    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.num_slots = num_slots
        self._ready: OrderedDict[bytes, int] = OrderedDict()   # hash -> slot, least recently used first
        self._hash_of: dict[int, bytes] = {}                   # ready slot -> hash
        self._pending: dict[int, bytes] = {}                   # slot being written -> its hash
        self._pending_hashes: set[bytes] = set()
        self._pins: dict[int, int] = {}                        # slot -> loads in flight reading it
        self._dropped: set[int] = set()                        # dropped while pinned: free once unpinned
        self._free = list(range(num_slots - 1, -1, -1))
        self.hits = self.blocks_in = self.blocks_out = self.evictions = self.bad_blocks = 0

    def __len__(self) -> int:
        """Blocks held (ready)."""
        return len(self._ready)

    def find(self, digest: bytes) -> int | None:
        """The ready slot holding `digest`, or None."""
        return self._ready.get(digest)

    def holds(self, digest: bytes) -> bool:
        """Held or being written: a block worth no second copy."""
        return digest in self._ready or digest in self._pending_hashes

    def touch(self, digest: bytes) -> None:
        if digest in self._ready:
            self._ready.move_to_end(digest)

    # writes
    def reserve(self, digest: bytes) -> int | None:
        """A slot to write `digest` into (pending until `commit`): a free one, else the least recently used
        unpinned one (evicted); None when every slot is pinned or being written, or `digest` is held already."""
        if self.holds(digest):
            return None
        slot = self._free.pop() if self._free else self._evict()
        if slot is not None:
            self._pending[slot] = digest
            self._pending_hashes.add(digest)
        return slot

    def _evict(self) -> int | None:
        for digest, slot in self._ready.items():
            if slot not in self._pins:
                del self._ready[digest], self._hash_of[slot]
                self.evictions += 1
                return slot
        return None

    def commit(self, slot: int) -> None:
        """The step that wrote `slot` ended: its block is readable (most recently used)."""
        digest = self._pending.pop(slot)
        self._pending_hashes.discard(digest)
        self._ready[digest] = slot
        self._hash_of[slot] = digest
        self.blocks_in += 1

    def abandon(self, slot: int) -> None:
        """The write into `slot` failed or its step never ended: the slot is free again, its bytes unread."""
        self._pending_hashes.discard(self._pending.pop(slot))
        self._free.append(slot)

    # reads
    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._ready.move_to_end(self._hash_of[slot])

    def unpin(self, slot: int, read: bool) -> None:
        """A load of `slot` ended (`read`: it used the block; else it failed or never ran)."""
        left = self._pins.pop(slot) - 1
        if left:
            self._pins[slot] = left
        elif slot in self._dropped:
            self._dropped.discard(slot)
            self._free.append(slot)
        if read:
            self.hits += 1
            self.blocks_out += 1

    def drop(self, slot: int) -> None:
        """`slot`'s block failed its check: forget it (free now, or once its last load has ended)."""
        digest = self._hash_of.pop(slot, None)
        if digest is None:
            return
        del self._ready[digest]
        self.bad_blocks += 1
        if slot in self._pins:
            self._dropped.add(slot)
        else:
            self._free.append(slot)

    def restore(self, held: Iterable[tuple[int, bytes]]) -> None:
        """Blocks found at start-up (a disk tier kept from before), least recently used first."""
        for slot, digest in held:
            if 0 <= slot < self.num_slots and slot not in self._hash_of and digest not in self._ready:
                self._ready[digest] = slot
                self._hash_of[slot] = digest
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in self._hash_of]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def check_consistency(self) -> None:
        """Raise AssertionError if a slot is counted twice or lost (used by tests)."""
        free, ready, pending = set(self._free), set(self._hash_of), set(self._pending)
        assert len(free) == len(self._free), "a slot free twice"
        assert not (free & ready or free & pending or ready & pending), "a slot in two states"
        assert self._dropped <= set(self._pins) and not self._dropped & (ready | pending | free), "dropped slots"
        assert len(free | ready | pending | self._dropped) == self.num_slots, "a slot lost"
        assert set(self._pins) <= ready | self._dropped, "a pin on a slot not held"
        assert {self._ready[h] for h in self._ready} == ready and len(self._ready) == len(ready), "hash map"
        assert self._pending_hashes == set(self._pending.values()), "pending hashes"
