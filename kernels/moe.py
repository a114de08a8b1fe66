"""A mixture-of-experts layer's experts over a step's rows, grouped by expert (the plain-torch reference).

Each row (token) chose `top_k` experts; a (row, choice) is a *pair*. The pairs are grouped by expert,
and each expert touched runs once over its rows: gather them (index_select), its gate/up projection, the
activation, its down projection, scale by the routing weight, and add back (index_add). An expert no
pair chose is never read. The Triton version (`grouped_gemm.py`) runs every expert in one launch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from pdserve.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref

ACTIVATIONS = ("silu", "swiglu_clamped", "gelu_tanh")

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def swiglu_clamped_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of x [T, 2I] = [gate | up]: gate clamped above at `limit`, up within +-limit,
    (up + 1) * gate * sigmoid(alpha * gate); returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(x: torch.Tensor, activation: str, alpha: float, limit: float,
                      silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref) -> torch.Tensor:
    if activation == "silu":
        return silu_and_mul(x)
    if activation == "swiglu_clamped":
        return swiglu_clamped_ref(x, alpha, limit)
    if activation == "gelu_tanh":                       # Gemma 4's experts
        return gelu_tanh_and_mul_ref(x)
    raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {activation!r}")


def expert_groups(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its pairs [n] int64, ascending) for every expert some pair chose, in expert order; pair p is row
    p // top_k's choice p % top_k."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, order[start:start + count]
        start += count


def check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None) -> None:
    experts, width, hidden = w13.shape
    assert x.dim() == 2 and x.shape[1] == hidden and width % 2 == 0
    assert w2.shape == (experts, hidden, width // 2) and w2.dtype == w13.dtype == x.dtype
    assert topk_ids.shape == topk_weights.shape == (x.shape[0], topk_ids.shape[1])
    assert b13 is None or b13.shape == (experts, width)
    assert b2 is None or b2.shape == (experts, hidden)


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                    activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, linear: Linear = F.linear,
                    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref) -> torch.Tensor:
    """sum over each row's k choices of weight * down(act(gate_up(x))) of that expert; x [T, H], w13 [E, 2I, H]
    (gate rows then up rows), w2 [E, H, I], topk_ids / topk_weights [T, k]; returns [T, H] in x's dtype.
    `linear` and `silu_and_mul` run each expert's projections and activation (a backend's kernels)."""
    check_experts(x, w13, w2, topk_ids, topk_weights, b13, b2)

    def expert_mlp(h: torch.Tensor, expert: int) -> torch.Tensor:
        gate_up = linear(h, w13[expert], None if b13 is None else b13[expert])
        return linear(expert_activation(gate_up, activation, alpha, limit, silu_and_mul), w2[expert],
                      None if b2 is None else b2[expert])

    out = torch.zeros_like(x)
    if x.shape[0] == 1:                        # one row (one-stream decode): its experts in turn, nothing gathered
        for expert, weight in sorted(zip(topk_ids[0].tolist(), topk_weights[0].tolist())):
            out += (expert_mlp(x, expert).float() * weight).to(x.dtype)     # NOTE: weighted in float32
        return out
    top_k, weights = topk_ids.shape[1], topk_weights.reshape(-1)
    for expert, pairs in expert_groups(topk_ids, w13.shape[0]):
        rows = pairs // top_k
        y = expert_mlp(x.index_select(0, rows), expert)
        out.index_add_(0, rows, (y * weights[pairs, None]).to(x.dtype))     # NOTE: weighted in float32
    return out
