"""Gemma 4's MLP with experts (26B-A4B): the dense MLP and a mixture of experts side by side, each output normed,
summed. The router and the experts read the residual stream (the experts through a norm of their own); the router
norms it without a scale, scales it per channel and by hidden ** -0.5, keeps the top k of a softmax over every
expert, renormalised, each weight times its expert's stored scale."""
from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.layers import MLP, RMSNorm, empty_parameter
from pdserve.engine.model.moe import route


class Gemma4Router(nn.Module):
    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, hidden = config.experts, config.hidden_size
        self.weight = empty_parameter(e.num_experts, hidden)
        self.scale = empty_parameter(hidden)
        self.expert_scale = empty_parameter(e.num_experts)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, scaled=False)
        self.top_k, self.root = e.top_k, hidden ** -0.5

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        h = self.norm(residual) * self.scale * self.root
        weights, ids = route(kernels.linear(h, self.weight, None, self.backend), self.top_k, "softmax_topk", True)
        return weights * self.expert_scale[ids], ids


class Gemma4MoE(nn.Module):
    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig, intermediate_size: int = 0) -> None:
        super().__init__()
        e, hidden, eps = config.experts, config.hidden_size, config.rms_norm_eps
        self.dense = MLP(config, intermediate_size)
        self.router = Gemma4Router(config)
        self.w13 = empty_parameter(e.num_experts, 2 * e.intermediate_size, hidden)
        self.w2 = empty_parameter(e.num_experts, hidden, e.intermediate_size)
        self.dense_output_norm = RMSNorm(hidden, eps)
        self.experts_input_norm = RMSNorm(hidden, eps)
        self.experts_output_norm = RMSNorm(hidden, eps)

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix this block hands `kernels.linear` besides its dense MLP's (each expert's, the router's)."""
        return [self.router.weight, *self.w13.unbind(0), *self.w2.unbind(0)]

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`h`: the normed input of the dense MLP; `residual`: the stream it was normed from."""
        dense = self.dense_output_norm(self.dense(h))
        weights, ids = self.router(residual)
        experts = kernels.moe_experts(self.experts_input_norm(residual), self.w13, self.w2, ids, weights,
                                      activation="gelu_tanh", backend=self.backend)
        return dense + self.experts_output_norm(experts)
