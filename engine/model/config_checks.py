"""The checks a parsed ModelConfig must pass before anything is built from it."""
from __future__ import annotations

from pathlib import Path

from pdserve.engine.model.families import ConfigError


def validate_config(c, path: Path) -> None:
    """Raise ConfigError naming `path` where the config `c` (a ModelConfig) cannot be served."""
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings")
    for name in positive:
        if getattr(c, name) <= 0:
            raise ConfigError(f"{path}: {name} must be positive, got {getattr(c, name)}")
    if c.num_heads % c.num_kv_heads:
        raise ConfigError(f"{path}: num_attention_heads ({c.num_heads}) is not a multiple of "
                          f"num_key_value_heads ({c.num_kv_heads})")
    for i, kind in enumerate(c.layer_kinds):
        if kind.head_dim < 0 or kind.kv_heads < 0 or c.num_heads % c.layer_kv_heads(i):
            raise ConfigError(f"{path}: layer {i}'s {c.layer_kv_heads(i)} KV heads of {c.layer_head_dim(i)} "
                              f"do not divide its {c.num_heads} query heads")
    if len(c.layer_kinds) != c.num_layers:
        raise ConfigError(f"{path}: layer_types lists {len(c.layer_kinds)} layers for num_hidden_layers "
                          f"{c.num_layers}")
    for rope, head_dim in {(kind.rope, c.layer_head_dim(i)) for i, kind in enumerate(c.layer_kinds)
                           if kind.rope is not None}:
        rotary = rope.rotary_dim(head_dim)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ConfigError(f"{path}: a rotary embedding over {rotary} of head_dim {head_dim} dimensions "
                              f"(partial_rotary_factor {rope.partial_rotary_factor}) is not an even part of a head")
        if rope.rope_type == "longrope" and len(rope.short_factor) != rotary // 2:
            raise ConfigError(f"{path}: rope_scaling short_factor and long_factor need {rotary // 2} values "
                              f"(rotary dimensions / 2), got {len(rope.short_factor)}")
