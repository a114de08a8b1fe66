"""Gemma 4's per-layer inputs: every layer adds, after its MLP, a gated projection of an input of its own per
token, made once per step from the token's own per-layer embedding and a projection of its embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.layers import Embedding, Linear, RMSNorm


class PerLayerInputs(nn.Module):
    """Every layer's input for each token: [T, layers, width]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers, self.width = config.num_layers, config.per_layer_input_size
        self.embedding = Embedding(config.per_layer_vocab_size, self.layers * self.width)
        self.projection = Linear(config.hidden_size, self.layers * self.width)
        self.norm = RMSNorm(self.width, config.rms_norm_eps)
        self.projection_scale = config.hidden_size ** -0.5

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """`embedded`: the tokens' (scaled) embeddings [T, hidden]."""
        tokens = ids.shape[0]
        own = self.embedding(ids)
        own = own * torch.tensor(self.width ** 0.5, dtype=own.dtype)     # NOTE: in the weights' dtype, as transformers
        projected = self.projection(embedded) * self.projection_scale
        projected = self.norm(projected.reshape(tokens * self.layers, self.width))
        return (projected.view(tokens, self.layers, self.width) + own.view(tokens, self.layers, self.width)) * 2 ** -0.5


class PerLayerInput(nn.Module):
    """One layer's use of its input: norm(projection(act(gate(h)) * input)), added to the residual stream."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, config.per_layer_input_size)
        self.projection = Linear(config.per_layer_input_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, h: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        gate = self.gate(h)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.norm(self.projection(gate * layer_input))
