"""Every tensor a GGUF file must hold, by llama.cpp's name (`blk.N.attn_q.weight`), and its Hugging Face name.

llama.cpp's converter permutes the rows of a Llama model's Q and K projections (for its rotary layout);
`TensorSpec.unpermute_heads` says how to undo it.
"""
from __future__ import annotations

from pdserve.engine.model.gguf_config import Dims, TensorSpec
from pdserve.engine.model.gguf_reader import GGUFFile


def tensor_specs(f: GGUFFile, d: Dims) -> dict[str, TensorSpec]:
    """Every tensor the file must hold, by GGUF name (output.weight only when present: else tied)."""
    a = f.arch
    vocab = f"{a('vocab_size')}, {a('embedding_length')}"
    specs = {"token_embd.weight": TensorSpec("model.embed_tokens.weight", (d.vocab_size, d.hidden_size), vocab),
             "output_norm.weight": TensorSpec("model.norm.weight", (d.hidden_size,), a("embedding_length"))}
    if "output.weight" in f.tensors:
        specs["output.weight"] = TensorSpec("lm_head.weight", (d.vocab_size, d.hidden_size), vocab)
    for i in range(d.num_layers):
        specs |= _layer_specs(f, d, i)
    return specs


def _layer_specs(f: GGUFFile, d: Dims, i: int) -> dict[str, TensorSpec]:
    a, b, m, llama = f.arch, f"blk.{i}.", f"model.layers.{i}.", f.architecture == "llama"
    q, kv, hidden, ffn = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size, d.intermediate_size
    q_keys = f"{a('attention.head_count')}, {a('attention.key_length')}, {a('embedding_length')}"
    kv_keys = f"{a('attention.head_count_kv')}, {a('attention.key_length')}, {a('embedding_length')}"
    ffn_keys = f"{a('feed_forward_length')}, {a('embedding_length')}"
    specs = {
        "attn_norm.weight": ("input_layernorm.weight", (hidden,), a("embedding_length"), None),
        "attn_q.weight": ("self_attn.q_proj.weight", (q, hidden), q_keys, d.num_heads if llama else None),
        "attn_k.weight": ("self_attn.k_proj.weight", (kv, hidden), kv_keys, d.num_kv_heads if llama else None),
        "attn_v.weight": ("self_attn.v_proj.weight", (kv, hidden), kv_keys, None),
        "attn_output.weight": ("self_attn.o_proj.weight", (hidden, q), q_keys, None),
        "ffn_norm.weight": ("post_attention_layernorm.weight", (hidden,), a("embedding_length"), None),
        "ffn_gate.weight": ("mlp.gate_proj.weight", (ffn, hidden), ffn_keys, None),
        "ffn_up.weight": ("mlp.up_proj.weight", (ffn, hidden), ffn_keys, None),
        "ffn_down.weight": ("mlp.down_proj.weight", (hidden, ffn), ffn_keys, None),
    }
    if not llama:                                                         # qwen2: q/k/v bias
        specs |= {"attn_q.bias": ("self_attn.q_proj.bias", (q,), q_keys, None),
                  "attn_k.bias": ("self_attn.k_proj.bias", (kv,), kv_keys, None),
                  "attn_v.bias": ("self_attn.v_proj.bias", (kv,), kv_keys, None)}
    return {b + name: TensorSpec(m + hf, shape, keys, heads) for name, (hf, shape, keys, heads) in specs.items()}
