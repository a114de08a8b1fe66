"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV pool."""
from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.attention import Attention
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.layers import Embedding, Linear, RMSNorm
from pdserve.engine.model.rope import cos_sin_table
from pdserve.kernels.native_decode_layers import DecodeLayers, LayerTensors


class MLP(nn.Module):
    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x), self.backend))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, batch, kv_pool, cos_sin):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, batch, kv_pool, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """forward() returns final hidden states [T, hidden]; compute_logits() projects rows to the vocabulary."""

    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.register_buffer("cos_sin", cos_sin_table(config.head_dim, max_positions, config.rope),
                             persistent=False)
        self._decode_layers: DecodeLayers | None = None
        self._decode_layers_for: int | None = None     # the first qkv weight's address when built

    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(batch.input_ids), None
        native = self.native_decode_layers(h) if batch.is_decode else None
        if native is not None:
            h, residual = kernels.decode_layers(native, h, kv_pool, batch.positions, batch.slot_mapping,
                                                self.cos_sin, batch.block_tables, batch.context_lens)
        else:
            for layer in self.layers:
                h, residual = layer(h, residual, batch, kv_pool, self.cos_sin)
        h, _ = self.norm(h, residual)
        return h

    def use_backend(self, backend: kernels.Backend) -> None:
        """Every op of this model takes `backend` from now on (a runner chooses it once, at load)."""
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend

    def native_decode_layers(self, h: torch.Tensor) -> DecodeLayers | None:
        """Every layer in one native call for this decode step, when the native kernels serve it."""
        if (self.backend or kernels.choose_backend(h)) is not kernels.Backend.NATIVE:
            return None
        layers = self.one_call_layers()
        return layers if layers is not None and layers.dtype == h.dtype and layers.serves(h.shape[0]) else None

    def one_call_layers(self) -> DecodeLayers | None:
        """The layers' table for the one-call native step (None where it cannot serve this model)."""
        built_for = self.layers[0].self_attn.qkv_proj.weight.data_ptr()   # NOTE: moved weights rebuild it
        if self._decode_layers_for != built_for:
            self._decode_layers, self._decode_layers_for = self._build_decode_layers(), built_for
        return self._decode_layers

    def forget_native_decode_layers(self) -> None:
        """Called when a projection module is replaced (quantization): the next step rebuilds the table."""
        self._decode_layers_for = None

    def _build_decode_layers(self) -> DecodeLayers | None:
        config = self.config
        layers = [_layer_tensors(layer) for layer in self.layers]
        if config.qk_norm or None in layers:
            return None
        return DecodeLayers.build(layers, config.num_heads, config.num_kv_heads, config.head_dim,
                                  config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return kernels.linear(hidden, self.embed_tokens.weight, backend=self.backend).float()  # logits: [S, V] fp32
        return self.lm_head(hidden).float()


def _layer_tensors(layer: DecoderLayer) -> LayerTensors | None:
    """None when a projection is neither a Linear nor a QuantizedLinear (nothing native can run it)."""
    modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    projections = [m.native_projection() if hasattr(m, "native_projection") else None for m in modules]
    if None in projections:
        return None
    return LayerTensors(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data, *projections)
