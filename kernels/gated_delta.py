"""A Gated DeltaNet layer's two stateful ops over a step's sequences, each keeping its state in a slot (plain torch).

`causal_conv1d_ref`: the short depthwise convolution over q, k and v, each sequence's last `kernel - 1` inputs
kept in its conv state. `gated_delta_rule_ref`: the delta rule with a decay (Yang et al., "Gated Delta
Networks"): per value head, S <- exp(g) S + k (beta (v - exp(g) S^T k))^T, output S^T q, with q and k
L2-normalised and q scaled by 1/sqrt(d_k); a prefill chunk runs chunked (the UT transform over blocks of
CHUNK tokens, as transformers' and FLA's chunked kernels do), a decode row one step. States are float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _spans(cu_seqlens: torch.Tensor | None, tokens: int) -> list[tuple[int, int]]:
    """Each sequence's (first token, token count); decode (None): one token each."""
    if cu_seqlens is None:
        return [(t, 1) for t in range(tokens)]
    bounds = cu_seqlens.tolist()
    return [(start, stop - start) for start, stop in zip(bounds[:-1], bounds[1:])]


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """silu(depthwise causal conv) of x [T, C] with weight [C, K], each sequence continuing from conv_states[slot]
    [C, K - 1] (its previous inputs, oldest first), which it leaves holding its last K - 1 inputs; [T, C] in x's
    dtype. cu_seqlens [S + 1]: sequence s is tokens cu[s]:cu[s+1]; None: one token per sequence (decode)."""
    kernel = weight.shape[1]
    w = weight.float()
    if cu_seqlens is None:                                          # decode: every sequence in one go
        window = torch.cat([conv_states[slots], x.float()[:, :, None]], dim=2)          # [S, C, K]
        conv_states[slots] = window[:, :, 1:]
        return F.silu((window * w).sum(dim=2)).to(x.dtype)
    out = torch.empty_like(x)
    for slot, (start, count) in zip(slots.tolist(), _spans(cu_seqlens, x.shape[0])):
        window = torch.cat([conv_states[slot], x[start:start + count].float().T], dim=1)  # [C, K - 1 + n]
        conv = sum(w[:, j:j + 1] * window[:, j:j + count] for j in range(kernel))        # [C, n]
        out[start:start + count] = F.silu(conv).T.to(x.dtype)
        conv_states[slot] = window[:, -(kernel - 1):]
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] -> float32 [T, Hv, Dk], L2-normalised, q scaled; each key head serves Hv / Hk value heads."""
    q, k = l2norm(q.float()), l2norm(k.float())
    ratio = value_heads // k.shape[1]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return q * q.shape[-1] ** -0.5, k


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         states: torch.Tensor, slots: torch.Tensor,
                         cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, Dv] in v's dtype; q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv];
    states [slots, Hv, Dk, Dv] float32, each sequence starting from states[slot] and leaving its last state there.
    cu_seqlens as causal_conv1d_ref's."""
    q, k = _heads(q, k, v.shape[1])
    vf, g, beta = v.float(), g.float(), beta.float()
    if cu_seqlens is None:
        out, states[slots] = _recurrent_step(q, k, vf, g, beta, states[slots])
        return out.to(v.dtype)
    out = torch.empty_like(vf)
    for slot, (start, count) in zip(slots.tolist(), _spans(cu_seqlens, v.shape[0])):
        part = slice(start, start + count)
        out[part], states[slot] = _chunked(q[part], k[part], vf[part], g[part], beta[part], states[slot])
    return out.to(v.dtype)


def _recurrent_step(q, k, v, g, beta, state):
    """One token per row: q, k [S, H, Dk], v [S, H, Dv], g, beta [S, H], state [S, H, Dk, Dv]."""
    state = state * g.exp()[..., None, None]
    recalled = (state * k[..., None]).sum(dim=-2)                             # [S, H, Dv]
    state = state + k[..., None] * ((v - recalled) * beta[..., None])[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def _chunked(q, k, v, g, beta, state):
    """One sequence, q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H], from state [H, Dk, Dv]: (o [n, H, Dv], state)."""
    n = q.shape[0]
    pad = (-n) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))               # [H, n + pad, D]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))                    # [H, n + pad]
    heads, chunks = q.shape[0], (n + pad) // CHUNK
    q, k, v = (x.reshape(heads, chunks, CHUNK, -1) for x in (q, k, v))
    g, beta = g.reshape(heads, chunks, CHUNK), beta.reshape(heads, chunks, CHUNK)
    decay = g.cumsum(dim=-1)                                                             # log decay since chunk start
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise                                   # the UT transform's system
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed, k_to_end = q * decay.exp()[..., None], k * (decay[..., -1:] - decay).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(chunks):
        new = values[:, c] - k_decayed[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ new
        state = state * decay[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ new
    return out.reshape(heads, -1, out.shape[-1])[:, :n].transpose(0, 1), state
