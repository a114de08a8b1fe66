"""Block hashes for prefix caching: a full block is named by a hash chained over its tokens.

A block's hash covers its parent's hash and its own token ids, and the chain starts from the
request's cache salt, so two blocks share a hash exactly when they hold the same tokens after
the same prefix under the same salt. SHA-256 keeps crafted collisions out of reach (a colliding
prompt would read another tenant's KV); it costs about a microsecond per block of 16 tokens.
"""
from __future__ import annotations

import hashlib
from array import array

from pdserve.engine.core.sequence import Sequence

_ROOT = b"pdserve-kv-v1\0"


def root_hash(cache_salt: str | None) -> bytes:
    return hashlib.sha256(_ROOT + (cache_salt or "").encode()).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_hashes(seq: Sequence, num_tokens: int, block_size: int) -> list[bytes]:
    """`seq.block_hashes`, extended to cover every full block of its first `num_tokens` tokens."""
    hashes = seq.block_hashes
    while len(hashes) < num_tokens // block_size:
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else root_hash(seq.request.cache_salt)
        hashes.append(block_hash(parent, seq.token_slice(start, start + block_size)))
    return hashes
