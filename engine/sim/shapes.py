"""The numbers of a decoder a cost model reads: from a model directory's config.json or a named shape."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections and the gated MLP (norms left out)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q_out + 2 * kv_out)
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_params(self) -> int:
        """Every weight a step reads: the layers and the LM head (the embedding lookup reads a row per token)."""
        return self.num_layers * self.layer_params + self.lm_head_params

    def kv_elements_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> ModelShape:
        return cls(config.model_dir.name, config.vocab_size, config.hidden_size, config.intermediate_size,
                   config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.max_position_embeddings, tuple(config.eos_token_ids))


NAMED_SHAPES = {shape.name: shape for shape in (
    # meta-llama/Llama-3.1-8B config.json
    ModelShape("llama-8b", 128256, 4096, 14336, 32, 32, 8, 128, 131072, (128001,)),
    # meta-llama/Llama-2-13b-hf config.json (DistServe's OPT/Llama-13B comparisons)
    ModelShape("llama-13b", 32000, 5120, 13824, 40, 40, 40, 128, 4096, (2,)),
)}
