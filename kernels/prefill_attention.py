"""Causal attention for a packed variable-length batch whose context sits in the KV pool."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdserve.kernels._triton import (
    INTERPRETED,
    jit,
    launch_fitting,
    next_power_of_2,
    shared_memory_limit,
    target_arch,
    tl,
)
from pdserve.kernels.decode_attention import attend, decode_attention_ref, gather_blocks, scaled_scores
from pdserve.kernels.kv_layout import KVLayout


def prefill_attention_ref(q: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                          cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float, decode_rows=decode_attention_ref,
                          window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, Hq, D]; cu_seqlens_q: [S+1]; context_lens: [S]; block_tables: [S, max_blocks]; sinks: [Hq]
    # NOTE: sequences of one shape run as one batched call; one-token rows (decode rows of a mixed
    # colocated step) all go through the decode path together, whatever their context.
    out = torch.empty_like(q)
    bounds, lengths = cu_seqlens_q.tolist(), context_lens.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for seq, context_len in enumerate(lengths):
        q_len = bounds[seq + 1] - bounds[seq]
        if q_len:
            groups.setdefault((q_len, 0 if q_len == 1 else context_len), []).append(seq)
    options = dict(window=window, softcap=softcap, sinks=sinks)
    for (q_len, context_len), seqs in groups.items():
        rows = torch.cat([torch.arange(bounds[s], bounds[s] + q_len) for s in seqs]).to(q.device)
        index = torch.tensor(seqs, device=q.device)
        if q_len == 1:
            out[rows] = decode_rows(q[rows], kv_pool, layer, block_tables[index], context_lens[index], scale,
                                    **options)
        else:
            qs = q[rows].view(len(seqs), q_len, *q.shape[1:])
            out[rows] = _same_shape_prefill(qs, kv_pool, layer, block_tables[index], context_len,
                                            scale, **options).flatten(0, 1)
    return out


def _same_shape_prefill(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
                        context_len: int, scale: float, window: int, softcap: float,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    # q: [m, q_len, Hq, D], every sequence with `context_len` tokens of context; returns the same shape
    q_len, block_size = q.shape[1], KVLayout.of(kv_pool).block_size
    first_seen = max(0, context_len - q_len - window + 1) if window else 0
    first_block, num_blocks = first_seen // block_size, -(-context_len // block_size)
    k, v = gather_blocks(kv_pool, layer, block_tables[:, first_block:num_blocks])  # [m, Hkv, n, D]
    start = first_block * block_size                                               # k's first position
    k, v = k[:, :, :context_len - start].to(q.dtype), v[:, :, :context_len - start].to(q.dtype)
    qs = q.transpose(1, 2)  # [m, Hq, q_len, D]
    if q_len == context_len and not (window or softcap or sinks is not None):
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)[:, None]
        k_pos = torch.arange(start, context_len, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)   # [q_len, n]
        o = attend(qs, k, v, visible, scale, softcap, sinks)
    return o.transpose(1, 2)


@jit(do_not_specialize=("layer", "stride_bts", "num_seqs", "num_tiles", "window"))
def _prefill_kernel(q_ptr, pool_ptr, out_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr, sinks_ptr,
                    layer, scale, softcap, window, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_pb, stride_pl, stride_pkv, stride_ps, stride_ph, stride_bts,
                    group, num_seqs, num_tiles, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    # NOTE: sequence b owns tiles [cu[b] // BLOCK_M + b, cu[b+1] // BLOCK_M + b + 1); the last tiles start first
    tile = num_tiles - 1 - tl.program_id(0)
    head = tl.program_id(1)
    low: tl.int32 = 0
    high = num_seqs
    while low < high:  # find the last sequence whose first tile is <= tile
        middle = (low + high) // 2
        if tl.load(cu_seqlens_ptr + middle) // BLOCK_M + middle <= tile:
            low = middle + 1
        else:
            high = middle
    seq = low - 1
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    tile_m = tile - (q_start // BLOCK_M + seq)
    if tile_m * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    m, d, n = tile_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    q_pos = context_len - q_len + m  # [BLOCK_M]
    d_mask = d < HEAD_DIM
    q_mask = (m < q_len)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    kv_base = pool_ptr + layer * stride_pl + (head // group) * stride_ph
    table = block_tables_ptr + seq * stride_bts
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diagonal = (context_len - q_len + tile_m * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(context_len, context_len - q_len + (tile_m + 1) * BLOCK_M)
    first = 0
    if HAS_WINDOW:  # the tile's first query sees from first_pos - window + 1 on
        first = tl.maximum(context_len - q_len + tile_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for stage in tl.static_range(2):  # 0: keys every query sees (but for a window's edge); 1: the diagonal, masked
        for tile in range(first + (diagonal - first) * stage, diagonal + (kv_end - diagonal) * stage, BLOCK_N):
            pos = tile + n
            in_context = pos < context_len
            block = tl.load(table + pos // PAGE_SIZE, mask=in_context, other=0)
            rows = block.to(tl.int64) * stride_pb + (pos % PAGE_SIZE) * stride_ps  # [BLOCK_N]
            kv_mask = in_context[:, None] & d_mask[None, :]
            k = tl.load(kv_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(kv_base + stride_pkv + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            qk = scaled_scores(q, k, scale, softcap, DOT_PRECISION, HAS_SOFTCAP)  # [BLOCK_M, BLOCK_N]
            if stage == 1:
                visible = (pos[None, :] <= q_pos[:, None]) & in_context[None, :]
                qk = tl.where(visible, qk, float("-inf"))
            if HAS_WINDOW:
                qk = tl.where(pos[None, :] > q_pos[:, None] - window, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
    if HAS_SINKS:  # the head's sink logit joins every row's denominator
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # NOTE: rows past the chunk (not stored) may see no key
    out_rows = out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# NOTE: (BLOCK_M, BLOCK_N, num_warps, num_stages) by (largest head_dim, bytes per element), for targets
# with 227 KB (sm_90), 163 KB (sm_80) and 99 KB (sm_86, sm_89 and the rest) of shared memory per block.
# tests/test_kernels_compile.py compiles the 2-byte rows and the fp32 head_dim 128 row for each target
# and checks the limit; the other fp32 rows take tiles that need no more shared memory than that one.
_TILES = {
    (64, 2): ((128, 64, 4, 3),) * 3,
    (128, 2): ((128, 64, 8, 3),) * 3,
    (256, 2): ((64, 32, 4, 2),) * 3,
    (64, 4): ((128, 32, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)),
    (128, 4): ((128, 32, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)),
    (256, 4): ((32, 16, 4, 1),) * 3,
}
SMALLER_TILES = ((64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1))  # when a chosen tile does not fit
INTERPRETER_TILE = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)


@functools.cache
def tile_configs(head_dim: int, element_bytes: int, arch: int | None) -> tuple[dict, ...]:
    """Tile configurations for `arch` (None: the interpreter), best first, then ever smaller ones."""
    if arch is None:
        return (INTERPRETER_TILE,)
    width = next(d for d in (64, 128, 256) if head_dim <= d)
    limit = shared_memory_limit(arch)
    column = 0 if limit >= 200 * 1024 else 1 if limit >= 160 * 1024 else 2
    chosen = _TILES[(width, 2 if element_bytes <= 2 else 4)][column]
    fallbacks = [t for t in SMALLER_TILES if t[0] * t[1] < chosen[0] * chosen[1]]
    return tuple(dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), t)) for t in (chosen, *fallbacks))


def prefill_attention_triton(q: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                             cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention for a packed batch; q [T, Hq, D] -> [T, Hq, D] (see prefill_attention_ref).

    Launches without reading anything back to the host."""
    num_tokens, num_q_heads, head_dim = q.shape
    layout = KVLayout.of(kv_pool)
    block_size, num_kv_heads = layout.block_size, layout.num_kv_heads
    num_seqs = context_lens.shape[0]
    assert layout.head_dim == head_dim and num_q_heads % num_kv_heads == 0 and 0 <= layer < layout.num_layers
    assert q.dtype == kv_pool.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert q.stride(2) == 1
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (num_seqs + 1,)
    assert context_lens.dtype == torch.int32 and context_lens.dim() == 1
    assert cu_seqlens_q.is_contiguous() and context_lens.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    assert q.device == kv_pool.device == cu_seqlens_q.device == context_lens.device == block_tables.device
    assert sinks is None or (sinks.shape == (num_q_heads,) and sinks.device == q.device and sinks.is_contiguous())
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    dot_fp32 = q.dtype == torch.float32 or INTERPRETED  # NOTE: the interpreter has no bf16 dot
    configs = tile_configs(head_dim, 4 if dot_fp32 else q.element_size(), target_arch(q.device))

    def launch(config: dict) -> None:
        num_tiles = num_tokens // config["BLOCK_M"] + num_seqs
        _prefill_kernel[(num_tiles, num_q_heads)](
            q, kv_pool, out, cu_seqlens_q, context_lens, block_tables, out if sinks is None else sinks,
            layer, scale, softcap or 1.0, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *layout.strides(kv_pool), block_tables.stride(0), num_q_heads // num_kv_heads, num_seqs, num_tiles,
            PAGE_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
            DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32", HAS_WINDOW=window > 0,
            HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, **config)

    launch_fitting(launch, configs, ("prefill", q.device, head_dim, q.dtype))
    return out
