"""A Gemma 4 GGUF file as llama.cpp's converter writes it: per-layer arrays for the KV heads
(`attention.head_count_kv`), MLP widths (`feed_forward_length`) and sliding layers
(`attention.sliding_window_pattern`); the full layers' head size in `attention.key_length`, the sliding ones' in
`attention.key_length_swa`; `attention.shared_kv_layers` last layers without K and V tensors; a full layer without
`attn_v` takes its values from its keys; the per-layer inputs' tensors; proportional RoPE as `rope_freqs.weight`
(1 for a turned pair, 1e30 for one left alone); with `expert_count` (26B-A4B) each layer's router, stacked
experts and their norms beside the dense MLP. Norms are stored as they are (no 1 + weight)."""
from __future__ import annotations

import numpy as np

from pdserve.engine.model.gguf_specs import Dims, TensorSpec
from pdserve.engine.model.gguf_reader import GGUFFile

SLIDING, FULL = "sliding_attention", "full_attention"


def _per_layer(f: GGUFFile, suffix: str, n: int) -> list:
    """A per-layer metadata array (a single value: every layer's)."""
    key = f.arch(suffix)
    value = f.value(key)
    if value is None:
        raise f.error(f"metadata key {key} is missing")
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise f.error(f"{key} lists {len(values)} layers for {f.arch('block_count')} = {n}")
    return values


def layer_types(f: GGUFFile, n: int) -> list[str]:
    return [SLIDING if sliding else FULL for sliding in _per_layer(f, "attention.sliding_window_pattern", n)]


def shared_layers(f: GGUFFile, n: int) -> int:
    shared = f.integer(f.arch("attention.shared_kv_layers"), 0)
    if not 0 <= shared < n:
        raise f.error(f"{f.arch('attention.shared_kv_layers')} = {shared} leaves no layer of {n} keeping K and V")
    return shared


def dims(f: GGUFFile, vocab: int) -> Dims:
    """The sliding layers' head size and KV heads, and the MLP width of the layers keeping K and V, as the model's."""
    n, heads = f.integer(f.arch("block_count")), f.integer(f.arch("attention.head_count"))
    types, kv_heads = layer_types(f, n), _per_layer(f, "attention.head_count_kv", n)
    sliding = types.index(SLIDING) if SLIDING in types else 0
    head_dim = f.integer(f.arch("attention.key_length_swa"), f.integer(f.arch("attention.key_length")))
    return Dims(vocab_size=vocab, hidden_size=f.integer(f.arch("embedding_length")),
                intermediate_size=_per_layer(f, "feed_forward_length", n)[0], num_layers=n, num_heads=heads,
                num_kv_heads=kv_heads[sliding], head_dim=head_dim, rotary_dim=head_dim)


def config(f: GGUFFile, d: Dims, rope_freqs: np.ndarray | None) -> dict:
    """config.json's Gemma 4 keys (as Gemma4TextConfig names them; the full layers' shape as `global_head_dim` and
    `num_global_key_value_heads`); `rope_freqs`: the file's rope_freqs.weight."""
    n, types = d.num_layers, layer_types(f, d.num_layers)
    full = [i for i, t in enumerate(types) if t == FULL]
    first_shared = n - shared_layers(f, n)
    kept_full = [i for i in full if i < first_shared]
    keys_as_values = bool(kept_full) and f"blk.{kept_full[0]}.attn_v.weight" not in f.tensors
    widths = _per_layer(f, "feed_forward_length", n)
    per_layer_embedding = f.tensors.get("per_layer_token_embd.weight")
    turned = 1.0 if rope_freqs is None else float(np.mean(rope_freqs < 1e10))
    sliding_rope = {"rope_type": "default", "rope_theta": f.number(f.arch("rope.freq_base_swa"), 10000.0)}
    swa_rotary = f.integer(f.arch("rope.dimension_count_swa"), d.head_dim)
    if swa_rotary != d.head_dim:
        sliding_rope["partial_rotary_factor"] = swa_rotary / d.head_dim
    keys = {
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh", "layer_types": types,
        "sliding_window": f.integer(f.arch("attention.sliding_window"), 512), "attention_bias": False,
        "final_logit_softcapping": f.value(f.arch("final_logit_softcapping")), "rope_scaling": None,
        "rope_parameters": {SLIDING: sliding_rope,
                            FULL: {"rope_type": "proportional", "partial_rotary_factor": turned,
                                   "rope_theta": f.number(f.arch("rope.freq_base"), 1e6)}},
        "global_head_dim": f.integer(f.arch("attention.key_length")), "attention_k_eq_v": keys_as_values,
        "num_kv_shared_layers": n - first_shared,
        "use_double_wide_mlp": any(widths[i] == 2 * widths[0] for i in range(first_shared, n)),
        "hidden_size_per_layer_input": f.integer(f.arch("embedding_length_per_layer_input"), 0),
        "vocab_size_per_layer_input": int(per_layer_embedding.shape[-1]) if per_layer_embedding is not None else 0,
    }
    if full:
        keys["num_global_key_value_heads"] = _per_layer(f, "attention.head_count_kv", n)[full[0]]
    experts = f.integer(f.arch("expert_count"), 0)
    if experts:
        keys |= {"enable_moe_block": True, "num_experts": experts,
                 "top_k_experts": f.integer(f.arch("expert_used_count")),
                 "moe_intermediate_size": f.integer(f.arch("expert_feed_forward_length"))}
    return keys


def model_tensors(f: GGUFFile, d: Dims) -> dict[str, TensorSpec]:
    """The per-layer inputs' tensors beside the layers (none where the model has no per-layer inputs)."""
    width = f.integer(f.arch("embedding_length_per_layer_input"), 0)
    if not width:
        return {}
    total, keys = d.num_layers * width, f"{f.arch('embedding_length_per_layer_input')}, {f.arch('block_count')}"
    embedding = f.tensors.get("per_layer_token_embd.weight")
    rows = int(embedding.shape[-1]) if embedding is not None else d.vocab_size
    return {"per_layer_token_embd.weight": TensorSpec("model.embed_tokens_per_layer.weight", (rows, total), keys),
            "per_layer_model_proj.weight": TensorSpec("model.per_layer_model_projection.weight",
                                                      (total, d.hidden_size), keys),
            "per_layer_proj_norm.weight": TensorSpec("model.per_layer_projection_norm.weight", (width,), keys)}


def layer_tensors(f: GGUFFile, d: Dims, i: int) -> dict[str, TensorSpec]:
    """Layer i's tensors: its attention in its own shape (none of K and V where it reuses an earlier layer's),
    its MLP in its own width, Gemma's four norms, its per-layer input and output scale."""
    a, b, m, n = f.arch, f"blk.{i}.", f"model.layers.{i}.", d.num_layers
    full = layer_types(f, n)[i] == FULL
    head_dim = f.integer(a("attention.key_length")) if full else d.head_dim
    kv = _per_layer(f, "attention.head_count_kv", n)[i] * head_dim
    q, hidden, ffn = d.num_heads * head_dim, d.hidden_size, _per_layer(f, "feed_forward_length", n)[i]
    heads, ffn_keys = f"{a('attention.head_count')}, {a('attention.key_length')}", a("feed_forward_length")
    specs = {"attn_q.weight": ("self_attn.q_proj.weight", (q, hidden), heads),
             "attn_q_norm.weight": ("self_attn.q_norm.weight", (head_dim,), heads),
             "attn_output.weight": ("self_attn.o_proj.weight", (hidden, q), heads),
             "ffn_gate.weight": ("mlp.gate_proj.weight", (ffn, hidden), ffn_keys),
             "ffn_up.weight": ("mlp.up_proj.weight", (ffn, hidden), ffn_keys),
             "ffn_down.weight": ("mlp.down_proj.weight", (hidden, ffn), ffn_keys),
             "layer_output_scale.weight": ("layer_scalar", (1,), "layer_output_scale")}
    if i < n - shared_layers(f, n):
        kv_keys = f"{a('attention.head_count_kv')}, {a('attention.key_length')}"
        specs |= {"attn_k.weight": ("self_attn.k_proj.weight", (kv, hidden), kv_keys),
                  "attn_k_norm.weight": ("self_attn.k_norm.weight", (head_dim,), kv_keys)}
        if f"{b}attn_v.weight" in f.tensors or not full:
            specs["attn_v.weight"] = ("self_attn.v_proj.weight", (kv, hidden), kv_keys)
    norm = (hidden,), a("embedding_length")
    specs |= {"attn_norm.weight": ("input_layernorm.weight", *norm),
              "post_attention_norm.weight": ("post_attention_layernorm.weight", *norm),
              "ffn_norm.weight": ("pre_feedforward_layernorm.weight", *norm),
              "post_ffw_norm.weight": ("post_feedforward_layernorm.weight", *norm)}
    width = f.integer(a("embedding_length_per_layer_input"), 0)
    if width:
        width_keys = a("embedding_length_per_layer_input")
        specs |= {"inp_gate.weight": ("per_layer_input_gate.weight", (width, hidden), width_keys),
                  "proj.weight": ("per_layer_projection.weight", (hidden, width), width_keys),
                  "post_norm.weight": ("post_per_layer_input_norm.weight", *norm)}
    return {b + name: TensorSpec(m + hf, shape, keys) for name, (hf, shape, keys) in (specs | _experts(f, d)).items()}


def _experts(f: GGUFFile, d: Dims) -> dict[str, tuple]:
    """A layer's experts beside its dense MLP (26B-A4B): the router with its scales, the stacked experts, their
    norms."""
    experts = f.integer(f.arch("expert_count"), 0)
    if not experts:
        return {}
    a, hidden = f.arch, d.hidden_size
    width, keys = f.integer(a("expert_feed_forward_length")), f"{a('expert_count')}, {a('expert_feed_forward_length')}"
    norm = (hidden,), a("embedding_length")
    return {"ffn_gate_inp.weight": ("router.proj.weight", (experts, hidden), keys),
            "ffn_gate_inp.scale": ("router.scale", *norm),
            "ffn_down_exps.scale": ("router.per_expert_scale", (experts,), keys),
            "ffn_gate_up_exps.weight": ("experts.gate_up_proj", (experts, 2 * width, hidden), keys),
            "ffn_down_exps.weight": ("experts.down_proj", (experts, hidden, width), keys),
            "post_ffw_norm_1.weight": ("post_feedforward_layernorm_1.weight", *norm),
            "pre_ffw_norm_2.weight": ("pre_feedforward_layernorm_2.weight", *norm),
            "post_ffw_norm_2.weight": ("post_feedforward_layernorm_2.weight", *norm)}
