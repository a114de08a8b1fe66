"""Paged decode attention: one query token per sequence against its cached context."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels._triton import INTERPRETED, jit, next_power_of_2, tl
from pdserve.kernels.kv_layout import KVLayout


def gather_blocks(kv_pool: torch.Tensor, layer: int,
                  block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every block in the tables, one copy each: two [S, Hkv, blocks * bs, D] views.

    Entries past a sequence's blocks (any value, -1 included) read block 0; callers mask them."""
    num_seqs, width = block_tables.shape
    layout = KVLayout.of(kv_pool)
    ids = block_tables.reshape(-1).long().clamp_min(0)
    k, v = (cache.flatten(1).index_select(0, ids)  # [S * width, bs*Hkv*D]: one memcpy per block
            .view(num_seqs, width * layout.block_size, layout.num_kv_heads, layout.head_dim).transpose(1, 2)
            for cache in layout.layer(kv_pool, layer))
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap(q k^T * scale), masked to `visible`, with a sink logit per head in the denominator) v.

    q: [m, Hq, Lq, D]; k, v: [m, Hkv, n, D]; visible: bool, broadcast to [m, Hq, Lq, n]; sinks: [Hq].
    As transformers' eager attention computes it (Gemma 2's soft-capping, gpt-oss's sinks); SDPA without either."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale            # [m, Hq, Lq, n]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs[..., :k.shape[2]], v)


def window_start(context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """The first position a query at the last of `context_lens` positions sees: a window of `window` tokens
    (itself included) or, with window 0, position 0."""
    return (context_lens - window).clamp_min(0) if window else torch.zeros_like(context_lens)


def decode_attention_ref(q: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, window: int = 0, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [S, Hq, D]; block_tables: [S, max_blocks]; context_lens: [S]; sinks: [Hq]
    num_seqs, num_q_heads, head_dim = q.shape
    k, v = gather_blocks(kv_pool, layer, block_tables)  # [S, Hkv, n, D]
    positions = torch.arange(k.shape[2], device=q.device)
    lens = context_lens.to(q.device)
    visible = (positions[None, :] < lens[:, None]) & (positions[None, :] >= window_start(lens, window)[:, None])
    visible[:, 0] |= lens == 0  # NOTE: an empty context attends to one row, zeroed below
    out = attend(q.view(num_seqs, num_q_heads, 1, head_dim), k.to(q.dtype), v.to(q.dtype),
                 visible[:, None, None, :], scale, softcap, sinks)
    out = out.view(num_seqs, num_q_heads, head_dim)
    return out.masked_fill((lens == 0).view(-1, 1, 1), 0.0)


@jit
def softcapped(scores, softcap):
    """softcap * tanh(scores / softcap), with tanh from exp (the interpreter has no tanh)."""
    x = scores / softcap
    t = tl.exp(-2.0 * tl.abs(x))
    return softcap * tl.where(x >= 0, 1.0, -1.0) * (1.0 - t) / (1.0 + t)


@jit
def scaled_scores(q, k, scale, softcap, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """q k^T * scale in log2 units (for exp2), soft-capped first when HAS_SOFTCAP."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if HAS_SOFTCAP:
        qk = softcapped(qk, softcap)
    return qk * 1.4426950408889634


@jit
def window_first(context_len, window):
    """The first position the last of `context_len` positions sees (0 without a window: window 0)."""
    return tl.maximum(context_len - tl.where(window > 0, window, context_len), 0)


# NOTE: num_splits and the strides derived from it (the mid_* tensors) vary with the batch
@jit(do_not_specialize=("layer", "stride_bts", "stride_ms", "stride_mh", "stride_ls", "stride_lh", "num_splits",
                        "window"))
def _decode_split_kernel(q_ptr, pool_ptr, block_tables_ptr, context_lens_ptr, mid_o_ptr, mid_lse_ptr,
                         layer, scale, softcap, window, stride_qs, stride_qh,
                         stride_pb, stride_pl, stride_pkv, stride_ps, stride_ph, stride_bts,
                         stride_ms, stride_mh, stride_msplit, stride_ls, stride_lh,
                         group, head_dim, num_splits, PAGE_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first = window_first(context_len, window)
    per_split = tl.cdiv(tl.cdiv(context_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, context_len)
    if end <= start:
        return
    g, d, n = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    heads = kv_head * group + g
    q_mask = (g < group)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    kv_base = pool_ptr + layer * stride_pl + kv_head * stride_ph
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bts + pos // PAGE_SIZE, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_pb + (pos % PAGE_SIZE) * stride_ps  # [BLOCK_N]
        kv_mask = valid[:, None] & (d < head_dim)[None, :]
        k = tl.load(kv_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_base + stride_pkv + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        qk = scaled_scores(q, k, scale, softcap, DOT_PRECISION, HAS_SOFTCAP)  # [BLOCK_G, BLOCK_N]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    mid = mid_o_ptr + seq * stride_ms + heads[:, None] * stride_mh + split * stride_msplit + d[None, :]
    tl.store(mid, acc / l_i[:, None], mask=q_mask)
    lse = mid_lse_ptr + seq * stride_ls + heads * stride_lh + split
    tl.store(lse, m_i + tl.log2(l_i), mask=g < group)


@jit(do_not_specialize=("stride_ms", "stride_mh", "stride_ls", "stride_lh", "num_splits", "window"))
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, context_lens_ptr, sinks_ptr, out_ptr,
                          stride_ms, stride_mh, stride_msplit, stride_ls, stride_lh,
                          stride_os, stride_oh, head_dim, num_splits, window,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    span = context_len - window_first(context_len, window)
    per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m_i = -1.0e30
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(num_splits):
        if split * per_split < span:
            lse = tl.load(mid_lse_ptr + seq * stride_ls + head * stride_lh + split)
            part = tl.load(mid_o_ptr + seq * stride_ms + head * stride_mh + split * stride_msplit + d,
                           mask=d_mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            old_weight, weight = tl.exp2(m_i - m_new), tl.exp2(lse - m_new)
            acc = acc * old_weight + part * weight
            l_i = l_i * old_weight + weight
            m_i = m_new
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        acc = acc * tl.exp2(m_i - m_new)
        l_i = l_i * tl.exp2(m_i - m_new) + tl.exp2(sink - m_new)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Context splits per (sequence, KV head): enough programs to fill the device, >= 128 tokens each.

    Depends only on shapes, never on context lengths, so a CUDA graph can capture it."""
    wanted = -(-16 * _sm_count(device) // (num_seqs * num_kv_heads))
    return max(1, min(wanted, -(-max_context // 128), 64))


def decode_attention_triton(q: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            num_splits: int | None = None, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Paged split-K decode attention; q [S, Hq, D] -> [S, Hq, D] (see decode_attention_ref)."""
    num_seqs, num_q_heads, head_dim = q.shape
    layout = KVLayout.of(kv_pool)
    block_size, num_kv_heads = layout.block_size, layout.num_kv_heads
    assert layout.head_dim == head_dim and num_q_heads % num_kv_heads == 0 and 0 <= layer < layout.num_layers
    assert q.dtype == kv_pool.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert q.stride(2) == 1
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.shape == (num_seqs,) and context_lens.is_contiguous()
    assert q.device == kv_pool.device == block_tables.device == context_lens.device
    assert sinks is None or (sinks.shape == (num_q_heads,) and sinks.device == q.device and sinks.is_contiguous())
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        max_context = min(window, block_tables.shape[1] * block_size) if window else block_tables.shape[1] * block_size
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_context, q.device)
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    mid_o = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    block_n = 64 if head_dim <= 128 else 32
    block_d = next_power_of_2(head_dim)
    dot_fp32 = q.dtype == torch.float32 or INTERPRETED  # NOTE: the interpreter has no bf16 dot
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_pool, block_tables, context_lens, mid_o, mid_lse,
        layer, scale, softcap or 1.0, window, q.stride(0), q.stride(1),
        *layout.strides(kv_pool), block_tables.stride(0), *mid_o.stride()[:3], *mid_lse.stride()[:2],
        group, head_dim, num_splits, PAGE_SIZE=block_size,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32", HAS_SOFTCAP=bool(softcap),
        num_warps=4, num_stages=2)
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        mid_o, mid_lse, context_lens, out if sinks is None else sinks, out, *mid_o.stride()[:3],
        *mid_lse.stride()[:2], out.stride(0), out.stride(1), head_dim, num_splits, window,
        BLOCK_N=block_n, BLOCK_D=block_d, HAS_SINKS=sinks is not None, num_warps=4)
    return out
