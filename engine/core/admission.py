"""The admission rule: may a sequence take blocks of a pool now?"""
from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_manager import BlockManager


def can_admit(blocks: BlockManager, seq_id: str, num_tokens: int, max_num_seqs: int | None = None,
              watermark: float = 1.0, prefix: Sequence[int] = ()) -> bool:
    """True when `seq_id` may grow to `num_tokens` tokens in `blocks`' pool, sharing the cached `prefix`.

    It must fit in the free blocks. An empty pool takes any sequence that fits (so a prompt
    longer than the watermark still runs); otherwise the pool must hold fewer than
    `max_num_seqs` other sequences (None: no limit) and stay at or under `watermark` usage once
    it is admitted. The defaults leave only the first rule: it fits.
    """
    needed = blocks.blocks_needed(seq_id, num_tokens, prefix)
    if needed > blocks.num_free:
        return False
    if blocks.num_sequences == 0:
        return True
    if max_num_seqs is not None and not blocks.holds(seq_id) and blocks.num_sequences >= max_num_seqs:
        return False
    return blocks.usage_after(needed) <= watermark
