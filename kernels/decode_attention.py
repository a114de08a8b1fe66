"""Paged decode attention: one query token per sequence against its cached context."""
from __future__ import annotations

import torch


def gather_kv(kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
              num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, num_tokens) of every sequence: two [S, num_tokens, Hkv, D] tensors.

    Positions past a sequence's blocks read block 0 (callers mask them)."""
    block_size = kv_pool.shape[3]
    positions = torch.arange(num_tokens, device=kv_pool.device)
    blocks = block_tables[:, positions // block_size].long().clamp_min(0)  # [S, n]
    offsets = (positions % block_size).expand_as(blocks)
    return kv_pool[:, layer, 0][blocks, offsets], kv_pool[:, layer, 1][blocks, offsets]


def decode_attention_ref(q: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    # q: [S, Hq, D]; block_tables: [S, max_blocks]; context_lens: [S]
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    group = num_q_heads // num_kv_heads
    max_len = int(context_lens.max())
    k, v = gather_kv(kv_pool, layer, block_tables, max_len)  # [S, n, Hkv, D]
    k = k.float().permute(0, 2, 3, 1)  # [S, Hkv, D, n]
    v = v.float().transpose(1, 2)  # [S, Hkv, n, D]
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k) * scale  # [S, Hkv, G, n]
    positions = torch.arange(max_len, device=q.device)
    padding = positions[None, :] >= context_lens[:, None].to(q.device)  # [S, n]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)  # [S, Hkv, G, D]
    return out.view(num_seqs, num_q_heads, head_dim).to(q.dtype)
