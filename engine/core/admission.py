"""The admission rules: may a sequence take blocks of a pool now, and which of its prefix is cached there?"""
from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.kv_tiers import KVTiers
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.sequence import Sequence as SequenceState


def can_admit(blocks: BlockManager, seq_id: str, num_tokens: int, max_num_seqs: int | None = None,
              watermark: float = 1.0, prefix: Sequence[int] = (), first_block: int = 0,
              window_from: int | None = None) -> bool:
    """True when `seq_id` may grow to `num_tokens` tokens in `blocks`' pool, sharing the cached `prefix` (a new
    table holding nothing before `first_block`, its window slots from position `window_from`: `BlockManager.grow`).

    It must fit in the free blocks. An empty pool takes any sequence that fits (so a prompt
    longer than the watermark still runs); otherwise the pool must hold fewer than
    `max_num_seqs` other sequences (None: no limit) and stay at or under `watermark` usage once
    it is admitted. The defaults leave only the first rule: it fits.
    """
    needed = blocks.blocks_needed(seq_id, num_tokens, prefix, first_block)
    if (needed > blocks.num_free or blocks.lacks_state_slot(seq_id)
            or blocks.lacks_window_slots(seq_id, num_tokens, prefix, window_from)):
        return False
    if blocks.num_sequences == 0:
        return True
    if max_num_seqs is not None and not blocks.holds(seq_id) and blocks.num_sequences >= max_num_seqs:
        return False
    return blocks.usage_after(needed) <= watermark


def cached_prefix(blocks: BlockManager, seq: SequenceState, num_tokens: int) -> list[int]:
    """The blocks of `blocks`' prefix cache that hold the KV of `seq`'s first `num_tokens` tokens
    (whole blocks from the start); none without prefix caching."""
    if not blocks.enable_caching:
        return []
    size = blocks.block_size
    return blocks.match(extend_hashes(seq, seq.num_tokens, size)[:num_tokens // size])


def computable_prefix(blocks: BlockManager, seq: SequenceState) -> list[int]:
    """The cached prefix a pool that computes `seq`'s next token may share: at most `(n - 1) // block_size`
    blocks of its n tokens.

    NOTE: the last token is always computed, for its logits. A decode pool receiving copied KV has no
    such token to compute and shares `cached_prefix(blocks, seq, n)`. A sequence that scores its prompt
    (`Sequence.scores_prompt`) computes every position: it shares nothing."""
    return cached_prefix(blocks, seq, shareable_blocks(seq, blocks.block_size) * blocks.block_size)


def shareable_blocks(seq: SequenceState, block_size: int) -> int:
    """How many of `seq`'s first blocks a pool that computes its next token may take from a cache (its pool's or
    a KV tier): see `computable_prefix`."""
    return 0 if seq.scores_prompt else (seq.num_tokens - 1) // block_size


def tier_hits(tiers: KVTiers | None, blocks: BlockManager, seq: SequenceState, cached: int) -> int:
    """Blocks of `seq` past its `cached` pool hits that the KV tiers hold, all loadable (0 without tiers)."""
    if tiers is None or not blocks.enable_caching:
        return 0
    return len(tiers.lookup(seq.block_hashes[cached:shareable_blocks(seq, blocks.block_size)]))


def uncached_tokens(blocks: BlockManager, seq: SequenceState, tiers: KVTiers | None = None) -> int:
    """Prompt tokens a pool would have to compute for `seq` (its prefix-cache hits, and the blocks after them
    that `tiers` hold, are not computed)."""
    hits = len(computable_prefix(blocks, seq))
    return seq.num_tokens - (hits + tier_hits(tiers, blocks, seq, hits)) * blocks.block_size
