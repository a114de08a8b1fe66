"""`--kv-verify`: each prefill-to-decode KV copy checked at both ends once it has landed. Each copied block's
fingerprint (a position-weighted sum of its bytes as 32-bit words, wrapping in 64 bits, computed on the pool's
own device) must be the same in both pools; a copy that differs is made again, and one that differs twice is
reported, so its request ends with an error instead of decoding from wrong KV."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.engine.transfer.base import KVTransfer, TransferHandle


class CopyCheck(NamedTuple):
    """What `--kv-verify` found in one step's copies: how many differed, and the keys of those that differed
    again when made a second time (their requests fail)."""

    mismatches: int = 0
    failed: tuple[str, ...] = ()


def fingerprints(pool: torch.Tensor, blocks: Sequence[int]) -> list[int]:
    """One integer per block of `pool`: equal for equal bytes, and a flipped or moved word changes it."""
    ids = torch.tensor(list(blocks), dtype=torch.long, device=pool.device)
    words = pool.index_select(0, ids).reshape(len(blocks), -1).view(torch.int32).long()
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.long, device=pool.device)
    return (words * weights).sum(dim=1).tolist()


def copy_matches(src_pool: torch.Tensor, dst_pool: torch.Tensor, src: Sequence[int], dst: Sequence[int]) -> bool:
    return not src or fingerprints(src_pool, src) == fingerprints(dst_pool, dst)


def check_copies(copies: Sequence[tuple[str, TransferHandle, KVTransfer, torch.Tensor, torch.Tensor, tuple, tuple]]
                 ) -> CopyCheck:
    """Wait for each (key, handle, transfer, src pool, dst pool, src blocks, dst blocks) copy and check it; make a
    copy that differs again, once."""
    mismatches, failed = 0, []
    for key, handle, transfer, src_pool, dst_pool, src, dst in copies:
        handle.wait()
        if copy_matches(src_pool, dst_pool, src, dst):
            continue
        mismatches += 1
        transfer.copy_blocks(src_pool, dst_pool, src, dst).wait()
        if not copy_matches(src_pool, dst_pool, src, dst):
            failed.append(key)
    return CopyCheck(mismatches, tuple(failed))
