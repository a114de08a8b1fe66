"""Paged decode attention on CPU in C++ (kernels/csrc/decode_attention.cpp): K and V are read where
they lie in the pool, block by block with an online softmax; nothing is gathered.

Work items are (sequence, context split), each over whole blocks (every KV head: one contiguous
range per block); splits keep every thread busy when there are fewer sequences than threads, and a
second pass merges them by log-sum-exp. Consecutive rows with the same block table (a verifying
sequence's input token and its drafts, each seeing the positions before it) count as one sequence:
one pass over the context serves them all, so a verify step reads its KV once, not once per draft.
The reference
is kernels.decode_attention.decode_attention_ref (gather + SDPA).
"""
from __future__ import annotations

import functools

import torch

from pdserve.kernels.native import FLOAT, INT, INT64, POINTER, SUFFIXES, bind, int64_array

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE, MAX_SPLITS = 16, 512, 256, 64
TOKENS_PER_SPLIT = 256


@functools.cache
def _kernel(dtype: torch.dtype):
    return bind(f"pd_decode_attention_{SUFFIXES[str(dtype)]}", POINTER, POINTER, POINTER,
                INT64, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER, FLOAT, FLOAT, POINTER, INT)


def supports(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """True when the native kernel handles these shapes and dtypes."""
    _, _, _, block_size, num_kv_heads, head_dim = kv_pool.shape
    return (q.dtype in NATIVE_DTYPES and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and q.shape[-2] // num_kv_heads <= MAX_GROUP and block_size <= MAX_BLOCK_SIZE)


def num_splits(num_seqs: int, max_context: int, threads: int) -> int:
    """Context splits per sequence: enough items for every thread, >= TOKENS_PER_SPLIT tokens each."""
    wanted = -(-2 * threads // max(num_seqs, 1))
    return max(1, min(wanted, -(-max_context // TOKENS_PER_SPLIT), MAX_SPLITS))


def table_runs(block_tables: torch.Tensor) -> int:
    """Runs of consecutive rows with the same block table: the sequences one pass of the kernel serves each."""
    if block_tables.shape[0] < 2:
        return block_tables.shape[0]
    return 1 + int((block_tables[1:] != block_tables[:-1]).any(dim=1).sum())


def decode_attention_native(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence, q [S, Hq, D], over its paged context (its last `window` positions
    when window > 0; scores soft-capped when softcap > 0; sinks [Hq] in each head's denominator); [S, Hq, D]."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_layers, _, block_size, num_kv_heads, pool_head_dim = kv_pool.shape
    assert supports(q, kv_pool) and pool_head_dim == head_dim and num_q_heads % num_kv_heads == 0
    assert q.dtype == kv_pool.dtype and q.stride(2) == 1 and kv_pool.is_contiguous() and 0 <= layer < num_layers
    assert block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert block_tables.shape[0] == num_seqs and context_lens.shape == (num_seqs,) and context_lens.is_contiguous()
    assert q.is_cpu and kv_pool.is_cpu and block_tables.is_cpu and context_lens.is_cpu
    threads = torch.get_num_threads()
    context = min(window, block_tables.shape[1] * block_size) if window else block_tables.shape[1] * block_size
    splits = num_splits(table_runs(block_tables), context, threads)
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    assert sinks is None or sinks.shape == (num_q_heads,)
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype)
    partials = torch.empty((num_seqs, num_q_heads, splits, head_dim)) if splits > 1 else None
    lses = torch.empty((num_seqs, num_q_heads, splits)) if splits > 1 else None
    block, layer_stride, kv, slot, head = kv_pool.stride()[:5]
    _kernel(q.dtype)(q.data_ptr(), kv_pool.data_ptr() + layer * layer_stride * kv_pool.element_size(),
                     int64_array(block, kv, slot, head), block_size, block_tables.data_ptr(),
                     context_lens.data_ptr(), out.data_ptr(), None if partials is None else partials.data_ptr(),
                     None if lses is None else lses.data_ptr(),
                     int64_array(num_seqs, num_q_heads, num_kv_heads, head_dim, splits, q.stride(0),
                                 q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), window),
                     scale, softcap, None if sinks is None else sinks.data_ptr(), threads)
    return out
