"""What a Gemma 4 text config.json says, as transformers' Gemma4TextConfig reads it.

Gemma 4 sets its full-attention layers apart from its sliding ones: their own head size (`global_head_dim`) and,
where keys serve as values (`attention_k_eq_v`), their own KV head count; "proportional" RoPE over a quarter of
their heads. Its last `num_kv_shared_layers` layers keep no K and V: each reads those of the last earlier layer of
its own kind that keeps them (and with `use_double_wide_mlp` has an MLP twice as wide). Every layer adds a
per-layer input (`hidden_size_per_layer_input`: an embedding of its own per token and layer, plus a projection of
the token's embedding) and scales its output by a stored scalar. Values are RMS-normed without a scale; attention
scores are not scaled. With `enable_moe_block` (26B-A4B) each layer runs experts beside its dense MLP
(gemma4_moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
DEFAULTS = dict(sliding_window=512, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                tie_word_embeddings=True)


@dataclass(frozen=True, slots=True)
class LayerShape:
    """Where one Gemma 4 layer differs from the model's head size, KV heads and MLP width (0: the model's)."""

    head_dim: int = 0
    kv_heads: int = 0
    reuses_kv: bool = False
    intermediate_size: int = 0


def with_defaults(raw: dict) -> dict:
    """The config with Gemma4TextConfig's defaults where it leaves a key out (its layer types, 5 sliding to 1 full,
    the last one full, and each kind's RoPE)."""
    raw = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if raw.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention 'all': an encoder, not a causal language model")
    n = int(raw["num_hidden_layers"])
    types = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if types:
        types[-1] = FULL
    rope = raw.get("rope_parameters") or DEFAULT_ROPE
    return {**raw, "layer_types": types, "rope_parameters": rope, "use_bidirectional_attention": None}


def layer_shapes(raw: dict, types: list[str]) -> list[LayerShape]:
    """Each layer's head size, KV heads, K and V reuse and MLP width, from `per_layer_config` where the file has
    one (transformers writes it), else `global_head_dim` and `num_global_key_value_heads`."""
    per_layer = raw.get("per_layer_config")
    if isinstance(per_layer, dict):
        overrides = {int(i): dict(o) for i, o in per_layer.items()}
    else:
        full = {"head_dim": int(raw.get("global_head_dim") or 512)}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    reusing = kv_reusing_layers(types, int(raw.get("num_kv_shared_layers") or 0))
    wide = 2 * int(raw["intermediate_size"]) if raw.get("use_double_wide_mlp") else 0
    return [LayerShape(int(overrides.get(i, {}).get("head_dim") or 0),
                       int(overrides.get(i, {}).get("num_key_value_heads") or 0),
                       reuses, wide if reuses else 0) for i, reuses in enumerate(reusing)]


def kv_reusing_layers(types: list[str], shared: int) -> list[bool]:
    """Which layers read another layer's K and V: the last `shared` ones; ValueError where a kind among them has no
    earlier layer keeping its own."""
    first = len(types) - shared
    if shared < 0 or first < 1:
        raise ValueError(f"num_kv_shared_layers {shared} leaves no layer of {len(types)} keeping its K and V")
    if not set(types[first:]) <= set(types[:first]):
        raise ValueError("num_kv_shared_layers: a layer kind among the last layers has no earlier layer keeping "
                         "its K and V")
    return [i >= first for i in range(len(types))]


def features(raw: dict) -> dict:
    """ModelConfig's Gemma 4 fields."""
    size = int(raw.get("hidden_size_per_layer_input") or 0)
    return dict(value_norm=True, full_keys_as_values=bool(raw.get("attention_k_eq_v")),
                per_layer_input_size=size,
                per_layer_vocab_size=int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]) if size else 0,
                layer_scalars=True)
