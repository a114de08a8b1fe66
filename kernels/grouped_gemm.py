"""A mixture-of-experts layer's experts in Triton: one grouped-GEMM launch over every expert a step touches.

The step's (row, choice) pairs are sorted by expert on the device and each expert's run is padded to a
multiple of BLOCK_M (`align_pairs`, no host sync); each program multiplies one BLOCK_M run of pairs by one
BLOCK_N slice of its expert's weight, so an expert no pair chose has no program and is never read. Two
launches make a layer: gate/up (rows gathered from x), the activation, then down (scaled by the routing
weights); each row's k results are summed. The reference is `moe.moe_experts_ref` (index_select/index_add).
"""
from __future__ import annotations

import torch

from pdserve.kernels._triton import jit, tl
from pdserve.kernels.activation import silu_and_mul_triton
from pdserve.kernels.moe import check_experts, expert_activation

BLOCK_N = 64
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64     # the larger row tile once experts average that many pairs (prefill)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_ids [slots] int32: the pairs sorted by expert, each expert's run padded to a multiple of block_m
    with the filler `num_pairs`; block_experts [slots / block_m] int32: each block's expert, -1 past the last).
    Sized by the bound (every expert touched pads block_m - 1 slots at most), so nothing waits for the device and
    a CUDA graph can hold it (torch.bincount would read its maximum back)."""
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    ranked = flat[order]
    first = counts.cumsum(0) - counts
    slots = (ends - padded)[ranked] + torch.arange(num_pairs, device=device) - first[ranked]
    touched = min(num_pairs, num_experts)
    num_slots = -(-(num_pairs + touched * (block_m - 1)) // block_m) * block_m
    pair_ids = torch.full((num_slots,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[slots] = order.to(torch.int32)
    starts = torch.arange(0, num_slots, block_m, device=device)
    block_experts = torch.searchsorted(ends, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return pair_ids, block_experts


@jit(do_not_specialize=("num_pairs", "n", "k"))
def _grouped_gemm_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, pair_ids_ptr, block_experts_ptr, pair_weights_ptr,
                         num_pairs, n, k, stride_am, stride_we, stride_wn, stride_be, stride_cm,
                         ROWS_PER_PAIR: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = pairs // ROWS_PER_PAIR                               # NOTE: x's row of a pair, or the pair's own row
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < k), other=0.0)                   # a: [BLOCK_M, BLOCK_K]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)              # w: [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < n))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pair_ids: torch.Tensor,
                 block_experts: torch.Tensor, num_pairs: int, rows_per_pair: int, block_m: int,
                 pair_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """c [num_pairs, N]: row p = a[p // rows_per_pair] @ w[expert of p]^T (+ bias[expert]) (* pair_weights[p]);
    a [M, K], w [E, N, K] contiguous, bias [E, N]."""
    experts, n, k = w.shape
    assert a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1 and w.is_contiguous() and a.dtype == w.dtype
    assert bias is None or (bias.shape == (experts, n) and bias.stride(1) == 1)
    assert pair_weights is None or (pair_weights.shape == (num_pairs,) and pair_weights.dtype == torch.float32)
    c = torch.empty((num_pairs, n), dtype=out_dtype or a.dtype, device=a.device)
    fp32 = a.dtype == torch.float32
    grid = (block_experts.numel(), -(-n // BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, w if bias is None else bias, c, pair_ids, block_experts, c if pair_weights is None else pair_weights,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), 0 if bias is None else bias.stride(0), c.stride(0),
        ROWS_PER_PAIR=rows_per_pair, HAS_BIAS=bias is not None, MUL_WEIGHT=pair_weights is not None,
        DOT_PRECISION="ieee" if fp32 else "tf32", BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=32 if fp32 else 64,
        num_warps=4)
    return c


def moe_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                       *, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """`moe.moe_experts_ref` in two grouped-GEMM launches; x [T, H] -> [T, H] in x's dtype."""
    check_experts(x, w13, w2, topk_ids, topk_weights, b13, b2)
    tokens, top_k = topk_ids.shape
    num_pairs, experts = tokens * top_k, w13.shape[0]
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = LARGE_BLOCK_M if num_pairs >= LARGE_BLOCK_M * experts else SMALL_BLOCK_M
    pair_ids, block_experts = align_pairs(topk_ids, experts, block_m)
    gate_up = grouped_gemm(x, w13, b13, pair_ids, block_experts, num_pairs, top_k, block_m)     # [T*k, 2I]
    act = expert_activation(gate_up, activation, alpha, limit, silu_and_mul_triton)
    down = grouped_gemm(act.contiguous(), w2, b2, pair_ids, block_experts, num_pairs, 1, block_m,
                        topk_weights.reshape(-1).float().contiguous(), torch.float32)            # [T*k, H]
    return down.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
