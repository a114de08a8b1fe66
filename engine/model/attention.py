"""Self-attention over the paged KV pool: the q/k/v projection, rotary embedding, KV store and paged attention.

A layer's kind (`LayerKind`) sets its sliding window and rotary table (none: a NoPE layer); the family
sets the score scale, soft-cap, q/k/v norms, biases, sinks and an output gate (Qwen3-Next: q_proj also gives a
gate per head, the output is scaled by its sigmoid). A Gemma 4 layer may have its own head size and KV heads,
take its values from its key projection, or keep no K and V and read an earlier layer's. The kernels take the
window, cap and sinks as arguments, so every backend (native, Triton, torch) serves every kind.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.layers import Linear, RMSNorm, empty_parameter


class Attention(nn.Module):
    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        kind = config.layer_kinds[layer_index]
        self.layer_index = layer_index
        self.kv_layer = config.kv_layer(layer_index)      # its K and V's layer in the pool (recurrent ones keep none)
        self.split_layer = config.pool_layer(layer_index, split=True) if config.split_window else -1
        self.head_dim = head_dim = config.layer_head_dim(layer_index)
        self.num_heads, self.num_kv_heads = config.num_heads, config.layer_kv_heads(layer_index)
        self.q_size = config.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale, self.window, self.softcap = config.scale, kind.window, config.attn_softcap
        self.gate_size = self.q_size if config.attention_output_gate else 0
        self.reuses_kv = kind.reuses_kv                   # reads an earlier layer's K and V, keeps none
        self.keys_as_values = config.full_keys_as_values and not kind.window
        self.k_size = 0 if self.reuses_kv else self.kv_size
        self.v_size = 0 if self.reuses_kv or self.keys_as_values else self.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + self.gate_size + self.k_size + self.v_size,
                               config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm and not self.reuses_kv else None
        value_norm = config.value_norm and not self.reuses_kv
        self.v_norm = RMSNorm(head_dim, config.rms_norm_eps, scaled=False) if value_norm else None
        self.sinks = empty_parameter(config.num_heads) if config.attention_sinks else None

    def forward(self, h: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor,
                cos_sin: torch.Tensor | None) -> torch.Tensor:
        """`cos_sin`: this layer's rotary table, None for a layer without rotary embedding."""
        tokens = h.shape[0]
        q, gate, k, v = self.qkv_proj(h).split([self.q_size, self.gate_size, self.k_size, self.v_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)       # q: [T, Hq, D]
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
        layer, slots, tables = self.kv_layer, batch.slot_mapping, batch.block_tables
        if batch.window is not None:                    # NOTE: the sliding layers' K and V live apart
            layer = self.split_layer
            if self.window:
                kv_pool, slots, tables = batch.window.pool, batch.window.slot_mapping, batch.window.block_tables
        if self.reuses_kv:
            q = q if cos_sin is None else kernels.rotary_query(q, batch.positions, cos_sin, self.backend)
        else:
            q = self._store_kv(q, k, v if self.v_size else k, batch, kv_pool, layer, slots, cos_sin)
        options = dict(window=self.window, softcap=self.softcap, sinks=self.sinks)
        if batch.is_decode:
            o = kernels.decode_attention(q, kv_pool, layer, tables, batch.context_lens, self.scale, self.backend,
                                         **options)
        else:
            o = kernels.prefill_attention(q, kv_pool, layer, batch.cu_seqlens_q, batch.context_lens, tables,
                                          self.scale, self.backend, **options)
        o = o.reshape(tokens, self.q_size)
        return self.o_proj(o * torch.sigmoid(gate) if self.gate_size else o)

    def _store_kv(self, q, k, v, batch, kv_pool, layer, slots, cos_sin) -> torch.Tensor:
        """Norm, rotate and store this step's keys and values; returns the rotated queries."""
        tokens = q.shape[0]
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)    # k: [T, Hkv, D]
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        if self.v_norm is not None:
            v = self.v_norm(v.reshape(-1, self.head_dim)).view_as(v)
        if cos_sin is None:
            kernels.store_kv(k, v, kv_pool, layer, slots, self.backend)
            return q
        return kernels.rotary_store_kv(q, k, v, batch.positions, cos_sin, kv_pool, layer, slots, self.backend)
