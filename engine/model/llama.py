"""The decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3/4, Phi-3/4, SmolLM3; Mixtral, Qwen2/3-MoE and
gpt-oss with their experts; Qwen3-Next and Qwen3.5 with their recurrent layers) over a paged KV pool."""
from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.attention import Attention
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.gated_deltanet import GatedDeltaNet
from pdserve.engine.model.gemma4_moe import Gemma4MoE
from pdserve.engine.model.layers import MLP, Embedding, Linear, RMSNorm, empty_parameter
from pdserve.engine.model.moe import SparseMoE
from pdserve.engine.model.per_layer_inputs import PerLayerInput, PerLayerInputs
from pdserve.engine.model.rope import cos_sin_table
from pdserve.kernels.native_decode_layers import DecodeLayers, Head, LayerTensors, Projection


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each output normed again with `sandwich_norms` (Gemma 2/3).
    The residual sum rides along: each norm that follows a block adds its input to it (fused)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        recurrent = config.layer_kinds[layer_index].recurrent
        self.self_attn = None if recurrent else Attention(config, layer_index)
        self.linear_attn = GatedDeltaNet(config, layer_index) if recurrent else None
        kind = config.layer_kinds[layer_index]
        if not kind.experts:
            self.mlp = MLP(config, kind.intermediate_size)
        elif config.architecture == "gemma4":                 # experts beside the dense MLP, reading the stream
            self.mlp = Gemma4MoE(config, kind.intermediate_size)
        else:
            self.mlp = SparseMoE(config)
        self.mlp_reads_residual = isinstance(self.mlp, Gemma4MoE)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sandwich = config.sandwich_norms
        self.attention_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.per_layer_input = PerLayerInput(config) if config.per_layer_input_size else None
        self.layer_scalar = empty_parameter(1) if config.layer_scalars else None

    def forward(self, h, residual, batch, kv_pool, cos_sin, per_layer_input=None):
        if residual is None:
            residual, h = h, self.input_norm(h)
        else:
            h, residual = self.input_norm(h, residual)
        mixer = self.self_attn if self.linear_attn is None else self.linear_attn
        h = mixer(h, batch, kv_pool, cos_sin)
        if self.attention_output_norm is not None:
            h = self.attention_output_norm(h)
        h, residual = self.pre_mlp_norm(h, residual)
        h = self.mlp(h, residual) if self.mlp_reads_residual else self.mlp(h)
        if self.mlp_output_norm is not None:
            h = self.mlp_output_norm(h)
        if self.per_layer_input is not None:
            residual = h + residual
            h = self.per_layer_input(residual, per_layer_input)
        if self.layer_scalar is not None:
            h, residual = h * self.layer_scalar, residual * self.layer_scalar
        return h, residual


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
        rotations = [None if kind.rope is None else (kind.rope, config.layer_head_dim(i))
                     for i, kind in enumerate(config.layer_kinds)]
        ropes = list(dict.fromkeys(r for r in rotations if r is not None))
        self._tables = tuple("cos_sin" if i == 0 else f"cos_sin_{i}" for i in range(len(ropes)))
        for name, (rope, head_dim) in zip(self._tables, ropes):   # NOTE: one table per rotation and head size
            self.register_buffer(name, cos_sin_table(head_dim, max_positions, rope), persistent=False)
        self._layer_tables = tuple(None if r is None else ropes.index(r) for r in rotations)
        self.per_layer_inputs = PerLayerInputs(config) if config.per_layer_input_size else None
        self._decode_layers: DecodeLayers | None = None
        self._decode_layers_for: int | None = None     # the first qkv weight's address when built
        self._head: Head | None = None                 # the final norm and head, built with the layers' table
        self._one_call = _one_call_serves(config)

    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        h, residual = self._embed(batch), None
        native = self.native_decode_layers(h) if batch.is_decode else None
        if native is not None:
            h, residual = kernels.decode_layers(native, h, kv_pool, batch.positions, batch.slot_mapping,
                                                self.cos_sin, batch.block_tables, batch.context_lens)
        else:
            tables = [getattr(self, name) for name in self._tables]
            inputs = self.per_layer_inputs(batch.input_ids, h) if self.per_layer_inputs is not None else None
            for i, (layer, table) in enumerate(zip(self.layers, self._layer_tables)):
                h, residual = layer(h, residual, batch, kv_pool, None if table is None else tables[table],
                                    None if inputs is None else inputs[:, i])
        h, _ = self.norm(h, residual)
        return h

    def decode_logits(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor | None:
        """A decode step's logits (as `compute_logits(forward(...))` gives them) from one native call that runs
        the layers, the final norm and the head; None where that call does not serve the step."""
        rows = batch.input_ids.shape[0]
        layers = self._native_layers(rows, self.embed_tokens.weight.dtype) if batch.is_decode else None
        head = self._head if layers is not None else None
        if head is None or not head.serves(rows) or self.config.final_softcap:
            return None
        return kernels.decode_layers(layers, self._embed(batch), kv_pool, batch.positions, batch.slot_mapping,
                                     self.cos_sin, batch.block_tables, batch.context_lens, head)

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        if self.config.embed_scale != 1.0:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)    # NOTE: in h's dtype, as transformers
        return h

    def use_backend(self, backend: kernels.Backend) -> None:
        """Every op of this model takes `backend` from now on (a runner chooses it once, at load)."""
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend

    def native_decode_layers(self, h: torch.Tensor) -> DecodeLayers | None:
        """Every layer in one native call for this decode step, when the native kernels serve it."""
        return self._native_layers(h.shape[0], h.dtype, h)

    def _native_layers(self, rows: int, dtype: torch.dtype, h: torch.Tensor | None = None) -> DecodeLayers | None:
        backend = self.backend or (kernels.choose_backend(h) if h is not None else None)
        if backend is not kernels.Backend.NATIVE:
            return None
        layers = self.one_call_layers()
        return layers if layers is not None and layers.dtype == dtype and layers.serves(rows) else None

    def one_call_layers(self) -> DecodeLayers | None:
        """The layers' table for the one-call native step (None where it cannot serve this model)."""
        if not self._one_call:
            return None
        built_for = self.layers[0].self_attn.qkv_proj.weight.data_ptr()   # NOTE: moved weights rebuild it
        if self._decode_layers_for != built_for:
            self._decode_layers, self._decode_layers_for = self._build_decode_layers(), built_for
            self._head = None if self._decode_layers is None else self._build_head(self._decode_layers)
        return self._decode_layers

    def forget_native_decode_layers(self) -> None:
        """Called when a projection module is replaced (quantization): the next step rebuilds the table."""
        self._decode_layers_for = None

    def _build_decode_layers(self) -> DecodeLayers | None:
        config = self.config
        layers = [_layer_tensors(layer) for layer in self.layers]
        if None in layers:
            return None
        return DecodeLayers.build(layers, config.num_heads, config.num_kv_heads, config.head_dim,
                                  config.rms_norm_eps, config.layer_kinds[0].window)

    def _build_head(self, layers: DecodeLayers) -> Head | None:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.lm_head is None and type(head) is not Embedding:
            return None
        projection = Projection(head.weight.data) if self.lm_head is None else (
            head.native_projection() if hasattr(head, "native_projection") else None)
        return None if projection is None else Head.build(self.norm.weight.data, projection, layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """logits: [S, V] float32 (soft-capped where the family caps them)."""
        if self.lm_head is None:
            logits = kernels.linear(hidden, self.embed_tokens.weight, backend=self.backend).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def _one_call_serves(c: ModelConfig) -> bool:
    """Whether the one-call native decode step (Llama-style layers, one window and rotary table) fits the model."""
    kinds = set(c.layer_kinds)
    plain = not (c.qk_norm or c.sandwich_norms or c.attention_sinks or c.attn_softcap or c.attention_scale
                 or c.experts or c.linear_attention or c.attention_output_gate)
    return plain and c.hidden_act == "silu" and len(kinds) == 1 and c.layer_kinds[0].rope is not None


def _layer_tensors(layer: DecoderLayer) -> LayerTensors | None:
    """None when a projection is neither a Linear nor a QuantizedLinear (nothing native can run it)."""
    modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    projections = [m.native_projection() if hasattr(m, "native_projection") else None for m in modules]
    if None in projections:
        return None
    return LayerTensors(layer.input_norm.weight.data, layer.pre_mlp_norm.weight.data, *projections)
