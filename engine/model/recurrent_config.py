"""What a hybrid family's config.json says about its linear-attention (Gated DeltaNet) layers, as transformers
reads it (Qwen3-Next, Qwen3.5): their heads, the short convolution, and the fixed-size state each keeps per
sequence instead of a KV cache; which layers they are (`layer_types`, else every layer but each
`full_attention_interval`-th)."""
from __future__ import annotations

from dataclasses import dataclass

HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LINEAR = "linear_attention"
STATE_DTYPE_BYTES = 4                    # NOTE: states are kept in float32, whatever the pool's dtype


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    num_k_heads: int
    num_v_heads: int                     # a multiple of num_k_heads: each q/k head serves that many value heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int                     # the short convolution's width over q, k and v

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def projection_size(self) -> int:
        """The input projection's outputs: q, k, v, the output gate z, beta's b and the decay's a."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    @property
    def conv_state_floats(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def recurrent_state_floats(self) -> int:
        return self.num_v_heads * self.k_head_dim * self.v_head_dim

    def layer_params(self, hidden: int) -> int:
        """One layer's weights a token reads: its input and output projections (the convolution, decay and norm
        weights left out, as norms are)."""
        return hidden * self.projection_size + self.value_dim * hidden

    def state_bytes(self, layers: int) -> int:
        """One sequence's state over `layers` linear-attention layers."""
        return layers * (self.conv_state_floats + self.recurrent_state_floats) * STATE_DTYPE_BYTES


def linear_attention_config(raw: dict, architecture: str) -> LinearAttentionConfig | None:
    if architecture not in HYBRID_ARCHITECTURES:
        return None
    config = LinearAttentionConfig(int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                                   int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                                   int(raw.get("linear_conv_kernel_dim", 4)))
    if config.num_v_heads % config.num_k_heads or config.conv_kernel < 2:
        raise ValueError(f"linear_num_value_heads ({config.num_v_heads}) must be a multiple of linear_num_key_heads "
                         f"({config.num_k_heads}) and linear_conv_kernel_dim ({config.conv_kernel}) at least 2")
    return config


def hybrid_layer_types(raw: dict, n: int) -> list[str]:
    """Each layer's type: `layer_types`, else linear attention but for every `full_attention_interval`-th layer."""
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        return [LINEAR if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or any(t not in (LINEAR, "full_attention") for t in types):
        raise ValueError(f"layer_types must list 'linear_attention' or 'full_attention' per layer, got {types!r}")
    return list(types)
