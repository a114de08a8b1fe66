"""A KV pool's block ids in pure integers: free list, reference counts, prefix cache."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


NO_BLOCK = -1          # a table entry whose block went back to the pool: behind the KV window, never read again


class NoFreeBlocks(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """The block ids of one KV pool, in pure integers: the free list, reference counts and the prefix cache.

    Invariant: every block id is either on the free list (ref count 0) or held by one or more tables (ref count =
    number of holders). Prefix cache (`enable_caching`): a full block whose KV is computed can be registered under
    its hash; a new table takes the longest run of registered blocks matching its own hashes (sharing them: ref
    count + 1). A registered block keeps its hash on the free list, which is least-recently-used first: it stays
    reusable until it is handed out for new tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # first out first
        self._ref_counts = [0] * num_blocks
        self._cached: dict[bytes, int] = {}                 # hash -> block
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self.prefix_queries = 0                             # tokens looked up at admission
        self.prefix_hits = 0                                # of which found in the cache
        self.evicted: list[tuple[int, bytes]] | None = None   # (block, hash) of registered blocks handed out
        #                                                     again, while a KV tier wants them (else None)

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
        return block

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

    def _cached_run(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of `hashes` (none without caching)."""
        hits = []
        for digest in hashes if self.enable_caching else ():
            block = self._cached.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def _check_pool(self, held: dict[int, int]) -> None:
        """Raise AssertionError unless `held` (block -> holders) matches the ref counts and the free list."""
        for block in range(self.num_blocks):
            assert self._ref_counts[block] == held.get(block, 0), f"block {block} ref count"
            assert (block in held) != (block in self._free), f"block {block} both free and held"
        for digest, block in self._cached.items():
            assert self._hash_of[block] == digest, f"block {block} hash map"
