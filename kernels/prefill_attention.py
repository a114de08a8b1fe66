"""Causal attention for a packed variable-length batch whose context sits in the KV pool."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import gather_kv


def prefill_attention_ref(q: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                          cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [T, Hq, D]; cu_seqlens_q: [S+1]; context_lens: [S]; block_tables: [S, max_blocks]
    num_q_heads = q.shape[1]
    group = num_q_heads // kv_pool.shape[4]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if end == start:
            continue
        k, v = gather_kv(kv_pool, layer, block_tables[seq:seq + 1], context_len)  # [1, n, Hkv, D]
        k = k[0].float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = v[0].float().transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        causal = k_pos[None, :] <= q_pos[:, None]  # [q_len, n]
        qs = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal, scale=scale)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out
