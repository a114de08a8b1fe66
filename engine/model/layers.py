"""Parameter-only building blocks: weights are allocated empty and filled by the loader."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.kernels.native_decode_layers import Projection


def empty_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    backend: kernels.Backend | None = None     # set by CausalLM.use_backend; None: chosen per call

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features)
        self.bias = empty_parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, self.backend)

    def native_projection(self) -> Projection:
        """This linear as the one-call decode step runs it."""
        return Projection(self.weight.data, None if self.bias is None else self.bias.data)


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), gate and up fused; `intermediate_size` default: the config's."""

    backend: kernels.Backend | None = None

    def __init__(self, config: ModelConfig, intermediate_size: int = 0) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter)
        self.down_proj = Linear(inter, config.hidden_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x), self.backend))


ACTIVATIONS = {"silu": kernels.silu_and_mul, "gelu_pytorch_tanh": kernels.gelu_tanh_and_mul}


class RMSNorm(nn.Module):
    """norm(x) * weight; `scaled` False: no weight to load, the norm alone (Gemma 4's values and router input)."""

    backend: kernels.Backend | None = None

    def __init__(self, size: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        if scaled:
            self.weight = empty_parameter(size)
        else:
            self.register_buffer("weight", torch.ones(size), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual, self.backend)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = empty_parameter(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
