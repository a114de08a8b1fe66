"""A Gated DeltaNet layer (Qwen3-Next, Qwen3.5): linear attention whose per-sequence state replaces a KV cache.

One input projection gives q, k, v (through a short causal convolution), the output gate z, beta's b and
the decay's a; `kernels.gated_delta_rule` updates each sequence's recurrent state, and a gated RMSNorm and
the output projection follow. A sequence's conv and recurrent states live in its state slot
(`ForwardBatch.state`), which the runner zeroes before its first chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.layers import Linear, empty_parameter


class GatedDeltaNet(nn.Module):
    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        la = config.linear_attention
        self.config, self.eps = la, config.rms_norm_eps
        self.state_layer = config.state_layer(layer_index)
        self.in_proj = Linear(config.hidden_size, la.projection_size)
        self.conv_weight = empty_parameter(la.conv_dim, 1, la.conv_kernel)
        self.dt_bias = empty_parameter(la.num_v_heads)
        self.a_log = empty_parameter(la.num_v_heads)
        self.norm_weight = empty_parameter(la.v_head_dim)
        self.out_proj = Linear(la.value_dim, config.hidden_size)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; `kv_pool` and `cos_sin` unused (the layer keeps no KV, rotates nothing)."""
        la, state, tokens = self.config, batch.state, h.shape[0]
        qkv, z, b, a = self.in_proj(h).split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads], dim=-1)
        cu = batch.cu_seqlens_q
        qkv = kernels.causal_conv1d(qkv, self.conv_weight[:, 0], state.conv[self.state_layer], state.slots, cu,
                                    self.backend)
        q, k, v = qkv.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        beta = torch.sigmoid(b)
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = kernels.gated_delta_rule(q.reshape(tokens, la.num_k_heads, la.k_head_dim),
                                     k.reshape(tokens, la.num_k_heads, la.k_head_dim),
                                     v.reshape(tokens, la.num_v_heads, la.v_head_dim), g, beta,
                                     state.recurrent[self.state_layer], state.slots, cu, self.backend)
        o = self._gated_norm(o.reshape(-1, la.v_head_dim), z.reshape(-1, la.v_head_dim))
        return self.out_proj(o.reshape(tokens, la.value_dim))

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head, then times silu(z), as transformers' gated norm computes it."""
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.norm_weight
        return (normed * F.silu(z.float())).to(x.dtype)
