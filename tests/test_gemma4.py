"""Gemma 4's text model as transformers reads its config: each layer's head size and KV heads, which layers read
an earlier layer's K and V (and from which), their wider MLPs, the defaults a config leaves out, proportional RoPE,
the configs refused, the experts' router (26B-A4B) and the weights held; where its K and V live (tokens against transformers in every mode: test_model_parity,
test_engine_modes, test_coordinator, test_window_slots, test_text_of_multimodal)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers

from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model.rope import cos_sin_table
from pdserve.engine.worker.memory import kv_layout
from pdserve.engine.worker.window_pool import slot_blocks, window_layout
from pdserve.engine.worker.model_runner import load_model
from tests.hf_models import COMMON, gemma4_config, reference_model
from tests.models import engine_config, hf_checkpoint
from tests.test_moe_model import counted


def config_dir(tmp_path, **keys) -> ModelConfig:
    raw = {**COMMON, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "head_dim": 16, **keys}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(tmp_path)


def test_each_layers_shape_and_the_kv_it_reads_are_transformers():
    model = transformers.Gemma4ForCausalLM(gemma4_config())
    config = ModelConfig.from_dir(hf_checkpoint("gemma4"))
    modes = model.config.kv_sharing_modes
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        assert config.layer_head_dim(i) == attention.head_dim
        assert config.layer_kinds[i].reuses_kv == attention.is_kv_shared_layer
        assert (config.layer_kinds[i].intermediate_size or config.intermediate_size) == layer.mlp.intermediate_size
        if attention.is_kv_shared_layer:             # the last earlier layer of its kind storing its K and V
            kind = model.config.layer_types[i]
            source = next(j for j, m in enumerate(modes) if m == "store" and model.config.layer_types[j] == kind)
            assert config.kv_source(i) == source
        else:
            assert config.kv_source(i) == i
            assert config.layer_kv_heads(i) * attention.head_dim == attention.k_proj.out_features
            assert (attention.v_proj is None) == (config.full_keys_as_values and not config.layer_kinds[i].window)
    kept = sum(2 * layer.self_attn.k_proj.out_features for layer in model.model.layers
               if not layer.self_attn.is_kv_shared_layer)
    assert config.kv_elements_per_token() == kept and config.num_kv_layers == 4


def test_the_pool_holds_the_full_layers_and_a_slot_the_sliding_ones_in_their_own_shapes():
    config = ModelConfig.from_dir(hf_checkpoint("gemma4"))        # full: 1 KV head of 32; sliding: 2 of 16
    assert config.mixed_kv_shapes and config.split_window
    full, window = kv_layout(config, 16, split=True), window_layout(config, 16)
    assert (full.num_layers, full.num_kv_heads, full.head_dim) == (1, 1, 32)
    assert (window.num_layers, window.num_kv_heads, window.head_dim) == (3, 2, 16)
    assert slot_blocks(config) * full.block_elements == window.block_elements      # three blocks, exactly
    assert [config.pool_layer(i, split=True) for i in range(6)] == [0, 1, 0, 2, 2, 0]
    with pytest.raises(ValueError, match="different shapes"):
        kv_layout(config, 16)


def test_kv_tiers_are_refused_at_start_naming_them():
    config = engine_config(hf_checkpoint("gemma4"))
    with pytest.raises(ValueError, match="--kv-offload-memory"):
        Engine(replace(config, cache=replace(config.cache, kv_offload_memory=16 << 20)))


def test_a_published_config_naming_the_global_head_size_reads_as_transformers_per_layer_config(tmp_path):
    written = json.loads((hf_checkpoint("gemma4") / "config.json").read_text())
    assert "per_layer_config" in written
    published = {k: v for k, v in written.items() if k != "per_layer_config"}
    (tmp_path / "config.json").write_text(json.dumps({**published, "global_head_dim": 32,
                                                      "num_global_key_value_heads": 1}))
    assert ModelConfig.from_dir(tmp_path).layer_kinds == ModelConfig.from_dir(hf_checkpoint("gemma4")).layer_kinds


def test_what_a_config_leaves_out_is_transformers_default(tmp_path):
    config = config_dir(tmp_path, num_hidden_layers=12)
    hf = transformers.Gemma4TextConfig(**{**COMMON, "num_hidden_layers": 12}, head_dim=16)
    assert config.windows == tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert [config.layer_head_dim(i) for i in range(12)] == [hf.per_layer_config[i].head_dim for i in range(12)]
    full = config.layer_kinds[5].rope
    assert (full.rope_type, full.theta, full.partial_rotary_factor) == ("proportional", 1e6, 0.25)
    assert config.layer_kinds[0].rope.theta == 1e4 and config.attention_scale == 1.0
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings


def test_proportional_rope_turns_a_quarter_of_the_head_as_transformers_does():
    hf = gemma4_config()
    rotary = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(hf)
    positions = torch.arange(300)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, "full_attention")
    ours = cos_sin_table(32, 300, ModelConfig.from_dir(hf_checkpoint("gemma4")).layer_kinds[2].rope)
    assert torch.allclose(ours[:, :16], cos[0, :, :16]) and torch.allclose(ours[:, 16:], sin[0, :, :16])
    assert (ours[:, 4:16] == 1).all() and (ours[:, 20:] == 0).all()          # 4 of 16 pairs turn


@pytest.mark.parametrize("keys, reason", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=32), "top_k_experts"),
    (dict(use_bidirectional_attention="all"), "an encoder"),
    (dict(attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=3), "do not divide its 4 query"),
    (dict(num_hidden_layers=2, num_kv_shared_layers=2), "leaves no layer"),
    (dict(num_hidden_layers=6, num_kv_shared_layers=3,
          layer_types=["sliding_attention"] * 3 + ["full_attention"] * 3), "no earlier layer"),
])
def test_configs_it_cannot_serve_are_refused_with_the_reason(tmp_path, keys, reason):
    with pytest.raises(ConfigError, match=reason):
        config_dir(tmp_path, **keys)


def test_the_experts_router_is_transformers_router():
    """Gemma 4's router (an unscaled norm, a scale per channel and hidden ** -0.5, softmax over every expert, the
    top k renormalised and scaled per expert) against transformers' on random hidden states."""
    reference = reference_model(hf_checkpoint("gemma4-moe"))
    model = load_model(ModelConfig.from_dir(hf_checkpoint("gemma4-moe")), torch.float32, torch.device("cpu"), 64)
    h = torch.randn(50, reference.config.hidden_size) * 3
    with torch.no_grad():
        _, expected_weights, expected_ids = reference.model.layers[1].router(h)
        weights, ids = model.layers[1].mlp.router(h)
    assert torch.equal(ids, expected_ids) and len(ids.unique()) > 2
    assert torch.allclose(weights, expected_weights, atol=1e-6)
    assert not torch.allclose(expected_weights.sum(-1), torch.ones(50))     # the per-expert scales count


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-moe"])
def test_the_weights_it_holds_and_reads_are_transformers_parameters(arch):
    """Every projection of each layer in its own shape, the per-layer inputs' and the router's scales counted."""
    reference, config = reference_model(hf_checkpoint(arch)), ModelConfig.from_dir(hf_checkpoint(arch))
    assert config.stored_params == counted(reference)
