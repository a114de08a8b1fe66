"""What each model family's config.json says about its layers, as transformers reads it.

Layer kinds: which layers slide (a window) and with which rotary embedding (per-layer RoPE bases for
Gemma 3's local and global layers, none for SmolLM3's NoPE layers); rotary scaling (linear, Llama 3,
YaRN, LongRoPE), partial rotary; and the family-wide features (Gemma's norms, scale, soft-caps and
activation, gpt-oss's sinks, projection biases). Old and new spellings of each key are both read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.model import gemma4_config
from pdserve.engine.model.experts_config import expert_layers
from pdserve.engine.model.gemma4_config import LayerShape
from pdserve.engine.model.recurrent_config import HYBRID_ARCHITECTURES, LINEAR, hybrid_layer_types

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
ROPE_ALIASES = {"su": "longrope"}       # early Phi-3 128k checkpoints
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"
QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


class ConfigError(ValueError):
    """A model directory whose configuration cannot be used."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"                  # ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0                # llama3
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0          # rotary over this fraction of each head (Phi-4-mini: 0.75)
    beta_fast: float = 32.0                     # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None       # yarn, longrope: cos and sin times this (None: from factor)
    short_factor: tuple[float, ...] = ()        # longrope: per-frequency divisors up to the original context
    long_factor: tuple[float, ...] = ()         # and beyond it

    def rotary_dim(self, head_dim: int) -> int:
        """The dimensions rotated in pairs (i, i + rotary_dim / 2); "proportional" (Gemma 4) pairs over the whole
        head and leaves the pairs past its fraction unturned (frequency 0)."""
        if self.rope_type == "proportional":
            return head_dim
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True, slots=True)
class LayerKind:
    """How one decoder layer attends (its window and rotary embedding) and what its MLP is."""

    window: int = 0                             # the last `window` tokens, itself included (0: every token)
    rope: RopeConfig | None = None              # None: no rotary embedding (SmolLM3's NoPE layers)
    experts: bool = False                       # the MLP is a mixture of experts (ModelConfig.experts)
    recurrent: bool = False                     # linear attention with a state instead of KV (Gated DeltaNet)
    head_dim: int = 0                           # its heads' size where it differs from the model's (Gemma 4's full
    kv_heads: int = 0                           # layers), and its KV heads (0: the model's)
    reuses_kv: bool = False                     # keeps no K and V: reads the last earlier layer's of its kind
    intermediate_size: int = 0                  # its MLP's width where it differs from the model's (0: the model's)


def rope_config(raw: dict, params: dict | None = None) -> RopeConfig:
    """The rotary embedding of `params` (a rope_parameters dict), else of the config's top-level keys."""
    if params is None:
        params = raw.get("rope_parameters") or {}
        if isinstance(params.get(FULL), dict):                       # per layer type (Gemma 3)
            params = params[FULL]
        params = {**(raw.get("rope_scaling") or {}), **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    positions = int(raw.get("max_position_embeddings", 4096))
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or (positions if rope_type in ("yarn", "longrope") else 8192))
    default_factor = positions / original if rope_type in ("yarn", "longrope") else 1.0
    factor = float(params.get("factor") or default_factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None and rope_type == "yarn" and params.get("mscale") and params.get("mscale_all_dim"):
        attention_factor = _yarn_mscale(factor, params["mscale"]) / _yarn_mscale(factor, params["mscale_all_dim"])
    return RopeConfig(
        theta=theta, rope_type=rope_type, factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial_rotary_factor=float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * float(mscale) * math.log(factor) + 1.0 if factor > 1 else 1.0


def layer_kinds(raw: dict, architecture: str, num_layers: int, rope: RopeConfig) -> tuple[LayerKind, ...]:
    """Each layer's window and rotary embedding (and Gemma 4's per-layer shapes)."""
    types = _layer_types(raw, architecture, num_layers)
    window = int(raw.get("sliding_window") or 0)
    ropes = _layer_ropes(raw, architecture, num_layers, types, rope)
    experts = expert_layers(raw, architecture, num_layers)
    shapes = gemma4_config.layer_shapes(raw, types) if architecture == "gemma4" else [LayerShape()] * num_layers
    return tuple(LayerKind(window if t == SLIDING else 0, None if t == LINEAR else r, e, t == LINEAR,
                           s.head_dim, s.kv_heads, s.reuses_kv, s.intermediate_size)
                 for t, r, e, s in zip(types, ropes, experts, shapes))


def _layer_types(raw: dict, architecture: str, n: int) -> list[str]:
    if architecture in HYBRID_ARCHITECTURES:
        return hybrid_layer_types(raw, n)
    if not raw.get("sliding_window"):
        return [FULL] * n
    if architecture in QWEN + ("smollm3",) and not raw.get("use_sliding_window", False):
        return [FULL] * n
    if architecture in ("mistral", "mixtral", "phi3", "qwen3_moe"):   # every layer (they read no layer_types)
        return [SLIDING] * n
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"layer_types must list {SLIDING!r} or {FULL!r} per layer, got {types!r}")
        return list(types)
    if architecture in ("qwen2", "qwen3"):
        return [SLIDING if i >= int(raw.get("max_window_layers", 28)) else FULL for i in range(n)]
    if architecture == "qwen2_moe":
        last = int(raw.get("max_window_layers", 28))
        return [SLIDING if (i + 1) % 2 and i < last else FULL for i in range(n)]
    if architecture == "smollm3":
        return [FULL if uses_rope else SLIDING for uses_rope in _smollm3_rope_layers(raw, n)]
    if architecture in ("gemma2", "gpt_oss"):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if architecture == "gemma3":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    return [FULL] * n


def _layer_ropes(raw: dict, architecture: str, n: int, types: list[str], rope: RopeConfig) -> list:
    if architecture in ("gemma3", "gemma4"):
        params = raw.get("rope_parameters") or {}
        local = params.get(SLIDING)
        local = (rope_config(raw, local) if isinstance(local, dict)
                 else RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0))))
        return [local if t == SLIDING else rope for t in types]
    if architecture == "smollm3":
        return [rope if uses_rope else None for uses_rope in _smollm3_rope_layers(raw, n)]
    return [rope] * n


def _smollm3_rope_layers(raw: dict, n: int) -> list[bool]:
    flags = raw.get("no_rope_layers")                 # NOTE: 1 marks a layer that *uses* rotary embedding
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers for num_hidden_layers {n}")
    return [bool(f) for f in flags]


def family_features(raw: dict, architecture: str, hidden: int) -> dict:
    """ModelConfig's family-wide fields (norms, scale, soft-caps, activation, biases, sinks)."""
    if architecture == "gemma4":
        return _gemma4_features(raw, hidden)
    gemma, hybrid = architecture in ("gemma2", "gemma3"), architecture in HYBRID_ARCHITECTURES
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: an encoder (EmbeddingGemma), not a causal language model")
    activation = _activation(raw.get("hidden_activation") or raw.get("hidden_act") or "silu")
    bias = bool(raw.get("attention_bias", architecture in ("qwen2", "gpt_oss")))
    if architecture == "qwen2_moe":
        bias = bool(raw.get("qkv_bias", True))
    scalar = raw.get("query_pre_attn_scalar") if gemma else None
    return dict(
        attention_bias=bias and architecture not in ("mistral", "mixtral", "phi3"),
        o_proj_bias=bias and architecture not in ("qwen2", "qwen2_moe", "mistral", "mixtral", "phi3"),
        qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3", *HYBRID_ARCHITECTURES),
        attention_scale=float(scalar) ** -0.5 if scalar else 0.0,
        attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        attention_sinks=architecture == "gpt_oss",
        hidden_act=activation,
        norm_offset=1.0 if gemma or hybrid else 0.0,
        attention_output_gate=hybrid,
        sandwich_norms=gemma,
        embed_scale=hidden ** 0.5 if gemma else 1.0,
    )


def _gemma4_features(raw: dict, hidden: int) -> dict:
    """Gemma 4: q, k and (unscaled) v norms, unscaled scores, plain-weight norms, sandwich norms and its own
    per-layer inputs and scalars (gemma4_config)."""
    activation = _activation(raw.get("hidden_activation") or "gelu_pytorch_tanh")
    bias = bool(raw.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, attention_scale=1.0,
                final_softcap=float(raw.get("final_logit_softcapping") or 0.0), hidden_act=activation,
                sandwich_norms=True, embed_scale=hidden ** 0.5, **gemma4_config.features(raw))


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return name
