"""A Gated DeltaNet layer's two stateful ops in Triton; `gated_delta.py` holds their references and the maths.

`causal_conv1d_triton`: one program per block of packed tokens and block of channels, each token finding its
sequence in cu_seqlens on the device (binary search) and reading the inputs before its sequence's first from
the sequence's conv state slot. A prefill batch then writes each sequence's new conv state in a second launch
(a later token block of the same sequence must still read the old state); decode, whose every token is a
sequence of its own, writes it in the same program.

`gated_delta_rule_triton`: fused recurrent, one program per (sequence, value head, block of value columns) —
the columns of the state are independent of one another — holding that [Dk, BLOCK_V] slice of the state in
registers in float32 while it steps through the sequence's tokens, reading it from and leaving it in the
sequence's slot. Decode steps once; a prefill chunk steps token by token too (no chunked form yet).
"""
from __future__ import annotations

import torch

from pdserve.kernels._triton import jit, next_power_of_2, tl

CONV_BLOCK_T = 16
CONV_BLOCK_C = 128
STATE_BLOCK_V = 32
L2_EPS = 1e-6        # as gated_delta.l2norm's


@jit
def _sequence_of(cu_ptr, tokens, num_seqs, steps):
    """Each token's sequence: the first s with cu[s + 1] > token; `steps` = num_seqs.bit_length() halvings."""
    lo = tl.zeros_like(tokens)
    hi = lo + num_seqs
    for _ in range(steps):
        searching = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid + 1, mask=searching, other=0) <= tokens
        lo = tl.where(searching & right, mid + 1, lo)
        hi = tl.where(searching & ~right, mid, hi)
    return lo


@jit
def _store_conv_state(x_ptr, states_ptr, starts, counts, slots, chans, mask, stride_xt, stride_sn, stride_sc,
                      KERNEL: tl.constexpr):
    """Leave in each slot its sequence's last KERNEL - 1 inputs: the old state followed by the sequence's tokens."""
    rows = states_ptr + slots[:, None] * stride_sn + chans[None, :] * stride_sc
    for tap in tl.static_range(KERNEL - 1):
        past = counts + tap                       # the position in old state ++ tokens; below KERNEL - 1: the state
        from_x = (past >= KERNEL - 1)[:, None]
        xv = tl.load(x_ptr + (starts + past - (KERNEL - 1)).to(tl.int64)[:, None] * stride_xt + chans[None, :],
                     mask=mask & from_x, other=0.0)
        sv = tl.load(rows + past[:, None], mask=mask & ~from_x, other=0.0)
        # NOTE: a tap reads index counts + tap >= tap and writes index tap, so no read meets an earlier tap's write;
        # the barrier keeps every warp's reads (the decode conv's too) before any warp's write of this tap
        tl.debug_barrier()
        tl.store(rows + tap, tl.where(from_x, xv.to(tl.float32), sv), mask=mask)


@jit(do_not_specialize=("num_tokens", "channels", "num_seqs", "steps"))
def _conv_kernel(x_ptr, weight_ptr, states_ptr, slots_ptr, cu_ptr, out_ptr, num_tokens, channels, num_seqs, steps,
                 stride_xt, stride_wc, stride_wk, stride_sn, stride_sc, stride_ot,
                 KERNEL: tl.constexpr, DECODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = tokens < num_tokens
    mask = live[:, None] & (chans < channels)[None, :]
    if DECODE:
        seqs = tokens
        starts = tokens
    else:
        seqs = _sequence_of(cu_ptr, tokens, num_seqs, steps)
        starts = tl.load(cu_ptr + seqs, mask=live, other=0)
    slots = tl.load(slots_ptr + seqs, mask=live, other=0).to(tl.int64)
    state_rows = states_ptr + slots[:, None] * stride_sn + chans[None, :] * stride_sc
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(KERNEL):
        source = tokens - (KERNEL - 1 - tap)
        from_x = (source >= starts)[:, None]
        xv = tl.load(x_ptr + source.to(tl.int64)[:, None] * stride_xt + chans[None, :], mask=mask & from_x, other=0.0)
        sv = tl.load(state_rows + (KERNEL - 1 + source - starts)[:, None], mask=mask & ~from_x, other=0.0)
        w = tl.load(weight_ptr + chans * stride_wc + tap * stride_wk, mask=chans < channels, other=0.0)
        acc += tl.where(from_x, xv.to(tl.float32), sv) * w.to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + chans[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)
    if DECODE:
        _store_conv_state(x_ptr, states_ptr, starts, tl.full((BLOCK_T,), 1, tl.int32), slots, chans, mask,
                          stride_xt, stride_sn, stride_sc, KERNEL)


@jit(do_not_specialize=("channels", "num_seqs"))
def _conv_state_kernel(x_ptr, states_ptr, slots_ptr, cu_ptr, channels, num_seqs, stride_xt, stride_sn, stride_sc,
                       KERNEL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    seqs = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = seqs < num_seqs
    starts = tl.load(cu_ptr + seqs, mask=live, other=0)
    counts = tl.load(cu_ptr + seqs + 1, mask=live, other=0) - starts
    slots = tl.load(slots_ptr + seqs, mask=live, other=0).to(tl.int64)
    mask = live[:, None] & (chans < channels)[None, :]
    _store_conv_state(x_ptr, states_ptr, starts, counts, slots, chans, mask,
                      stride_xt, stride_sn, stride_sc, KERNEL)


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                         cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """As `causal_conv1d_ref`: silu(causal depthwise conv) of x [T, C] with weight [C, K], each sequence continuing
    from and updating conv_states[slot] [C, K - 1] (float32); cu_seqlens None: one token per sequence."""
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = slots.shape[0]
    assert weight.shape == (channels, kernel) and kernel >= 2 and x.stride(1) == 1
    assert conv_states.dtype == torch.float32 and conv_states.shape[1:] == (channels, kernel - 1)
    assert conv_states.stride(2) == 1 and slots.dim() == 1
    assert num_seqs == (num_tokens if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    decode = cu_seqlens is None
    cu = slots if decode else cu_seqlens
    block_c = min(CONV_BLOCK_C, next_power_of_2(channels))
    channel_blocks = _cdiv(channels, block_c)
    _conv_kernel[(_cdiv(num_tokens, CONV_BLOCK_T), channel_blocks)](
        x, weight, conv_states, slots, cu, out, num_tokens, channels, num_seqs, num_seqs.bit_length(),
        x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0), conv_states.stride(1), out.stride(0),
        KERNEL=kernel, DECODE=decode, BLOCK_T=CONV_BLOCK_T, BLOCK_C=block_c)
    if not decode:
        _conv_state_kernel[(_cdiv(num_seqs, CONV_BLOCK_T), channel_blocks)](
            x, conv_states, slots, cu_seqlens, channels, num_seqs, x.stride(0), conv_states.stride(0),
            conv_states.stride(1), KERNEL=kernel, BLOCK_S=CONV_BLOCK_T, BLOCK_C=block_c)
    return out


@jit(do_not_specialize=("key_dim", "value_dim", "heads_per_key"))
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, cu_ptr, out_ptr,
                      key_dim, value_dim, heads_per_key, scale, eps,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                      stride_bt, stride_bh, stride_sn, stride_sh, stride_sk, stride_ot, stride_oh,
                      VARLEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    key_head = head // heads_per_key
    if VARLEN:
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    else:
        start = seq.to(tl.int64)
        end = start + 1
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < key_dim, dv < value_dim
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_ptrs = states_ptr + slot * stride_sn + head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + dk, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + dk, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dv, mask=v_mask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + head * stride_gh).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_bt + head * stride_bh).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + eps) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        state = state * decay
        recalled = tl.sum(state * k[:, None], 0)
        state = state + k[:, None] * ((v - recalled) * beta)[None, :]
        o = tl.sum(state * q[:, None], 0)
        tl.store(out_ptr + t * stride_ot + head * stride_oh + dv, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state_ptrs, state, mask=state_mask)


def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slots: torch.Tensor,
                            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """As `gated_delta_rule_ref`: o [T, Hv, Dv] in v's dtype; q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv];
    states [slots, Hv, Dk, Dv] float32, updated in place; cu_seqlens None: one token per sequence."""
    num_tokens, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[1:]
    num_seqs = slots.shape[0]
    assert q.shape == k.shape and v.shape[0] == num_tokens and value_heads % key_heads == 0
    assert g.shape == beta.shape == (num_tokens, value_heads)
    assert states.dtype == torch.float32 and states.shape[1:] == (value_heads, key_dim, value_dim)
    assert q.stride(2) == k.stride(2) == v.stride(2) == states.stride(3) == 1
    assert num_seqs == (num_tokens if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    out = torch.empty((num_tokens, value_heads, value_dim), dtype=v.dtype, device=v.device)
    if num_tokens == 0:
        return out
    block_v = min(STATE_BLOCK_V, next_power_of_2(value_dim))
    _recurrent_kernel[(num_seqs, value_heads, _cdiv(value_dim, block_v))](
        q, k, v, g, beta, states, slots, slots if cu_seqlens is None else cu_seqlens, out,
        key_dim, value_dim, value_heads // key_heads, key_dim ** -0.5, L2_EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), states.stride(0), states.stride(1), states.stride(2),
        out.stride(0), out.stride(1),
        VARLEN=cu_seqlens is not None, BLOCK_K=next_power_of_2(key_dim), BLOCK_V=block_v)
    return out


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)
