"""A sparse mixture-of-experts MLP: a router picks each token's top-k experts and only those run.

The experts of a layer are stacked: `w13` [E, 2I, H] (each expert's gate rows, then its up rows) and
`w2` [E, H, I]; `kernels.moe_experts` groups a step's rows by expert and runs one matmul per expert
touched, so an expert no row chose is never read.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ExpertsConfig, ModelConfig
from pdserve.engine.model.layers import MLP, empty_parameter


class Router(nn.Module):
    """Scores every expert for each token and keeps the top k, with their weights."""

    backend: kernels.Backend | None = None

    def __init__(self, hidden: int, experts: ExpertsConfig) -> None:
        super().__init__()
        self.weight = empty_parameter(experts.num_experts, hidden)
        self.bias = empty_parameter(experts.num_experts) if experts.router_bias else None
        self.top_k, self.routing, self.normalize = experts.top_k, experts.routing, experts.norm_topk_prob

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int64)."""
        logits = kernels.linear(h, self.weight, self.bias, self.backend)      # logits: [T, E]
        return route(logits, self.top_k, self.routing, self.normalize)


def route(logits: torch.Tensor, top_k: int, routing: str, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts and their weights, as the family scores them (experts_config.ROUTINGS)."""
    if routing == "topk_softmax":                                  # gpt-oss: softmax over the k best logits
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values.float(), dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, ids


class SparseMoE(nn.Module):
    """The experts of one layer, with the shared expert and its gate where the family has them."""

    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, hidden = config.experts, config.hidden_size
        self.config = e
        self.router = Router(hidden, e)
        self.w13 = empty_parameter(e.num_experts, 2 * e.intermediate_size, hidden)
        self.w2 = empty_parameter(e.num_experts, hidden, e.intermediate_size)
        self.b13 = empty_parameter(e.num_experts, 2 * e.intermediate_size) if e.expert_bias else None
        self.b2 = empty_parameter(e.num_experts, hidden) if e.expert_bias else None
        self.shared_expert = MLP(config, e.shared_intermediate_size) if e.shared_intermediate_size else None
        self.shared_gate = empty_parameter(1, hidden) if e.shared_gate else None

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix this block hands `kernels.linear` (each expert's, the router's, the shared gate's)."""
        gates = [] if self.shared_gate is None else [self.shared_gate]
        return [self.router.weight, *self.w13.unbind(0), *self.w2.unbind(0), *gates]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(h)
        e = self.config
        out = kernels.moe_experts(h, self.w13, self.w2, ids, weights, self.b13, self.b2, activation=e.activation,
                                  alpha=e.swiglu_alpha, limit=e.swiglu_limit, backend=self.backend)
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(kernels.linear(h, self.shared_gate, None, self.backend))
            out = out + shared
        return out
