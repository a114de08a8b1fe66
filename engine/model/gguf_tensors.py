"""Every tensor a GGUF file must hold, by llama.cpp's name (`blk.N.attn_q.weight`), and its Hugging Face name.

Per family, as llama.cpp's converter writes them: Phi-3's fused `attn_qkv` and `ffn_up` (gate and up),
Gemma's four norms a layer (stored as 1 + weight: `TensorSpec.offset`, as are Qwen3-Next's and Qwen3.5's),
Qwen3's and Gemma 3's q/k norms, Qwen2's q/k/v biases, gpt-oss's biases and sinks; the experts of a
mixture-of-experts layer (gguf_experts.py); the Gated DeltaNet layers of a hybrid model, and the query
and output gate of its attention layers' attn_q (gguf_hybrid.py). The converter permutes the rows of the
Q and K projections of the architectures llama.cpp rotates interleaved (Llama, SmolLM3);
`TensorSpec.unpermute_heads` undoes it.
"""
from __future__ import annotations

from pdserve.engine.model import gguf_gemma4
from pdserve.engine.model.gguf_config import GEMMA
from pdserve.engine.model.gguf_specs import Dims, TensorSpec
from pdserve.engine.model.gguf_experts import expert_tensors, is_expert_layer
from pdserve.engine.model.gguf_hybrid import HYBRID, linear_attention_tensors, recurrent_layers
from pdserve.engine.model.gguf_reader import GGUFFile

PERMUTED_QK = ("llama", "smollm3")
QK_NORM = ("qwen3", "gemma3", "qwen3moe", *HYBRID)
QKV_BIAS = ("qwen2", "qwen2moe", "gpt-oss")
ZERO_CENTRED_NORMS = (*GEMMA, *HYBRID)          # RMSNorm scales by 1 + weight: llama.cpp stores 1 + weight
POST_ATTENTION_NORM = ("gpt-oss", *HYBRID)      # the MLP's input norm is `post_attention_norm` (else `ffn_norm`)


def tensor_specs(f: GGUFFile, d: Dims) -> dict[str, TensorSpec]:
    """Every tensor the file must hold, by GGUF name (output.weight only when present: else tied)."""
    a = f.arch
    vocab = f"{a('vocab_size')}, {a('embedding_length')}"
    offset = 1.0 if f.architecture in ZERO_CENTRED_NORMS else 0.0
    specs = {"token_embd.weight": TensorSpec("model.embed_tokens.weight", (d.vocab_size, d.hidden_size), vocab),
             "output_norm.weight": TensorSpec("model.norm.weight", (d.hidden_size,), a("embedding_length"),
                                              offset=offset)}
    if "output.weight" in f.tensors:
        specs["output.weight"] = TensorSpec("lm_head.weight", (d.vocab_size, d.hidden_size), vocab)
    if f.architecture == "gemma4":
        return specs | gguf_gemma4.model_tensors(f, d) | {
            name: spec for i in range(d.num_layers) for name, spec in gguf_gemma4.layer_tensors(f, d, i).items()}
    for i, recurrent in enumerate(recurrent_layers(f, d.num_layers)):
        specs |= _layer_specs(f, d, i, recurrent)
    return specs


def _layer_specs(f: GGUFFile, d: Dims, i: int, recurrent: bool) -> dict[str, TensorSpec]:
    a, b, m, arch = f.arch, f"blk.{i}.", f"model.layers.{i}.", f.architecture
    hidden, ffn = d.hidden_size, d.intermediate_size
    ffn_keys = f"{a('feed_forward_length')}, {a('embedding_length')}"
    norm = (hidden,), a("embedding_length")
    specs = {"attn_norm.weight": ("input_layernorm.weight", *norm)}
    mixer = linear_attention_tensors(f, hidden, i) if recurrent else {}
    if not recurrent:
        specs |= _attention(f, d)
    experts = expert_tensors(f, d, i) if is_expert_layer(f, i) else {}
    if not experts:
        specs["ffn_down.weight"] = ("mlp.down_proj.weight", (hidden, ffn), ffn_keys)
        if arch == "phi3":                              # gate and up fused, as the Hugging Face checkpoint stores them
            specs["ffn_up.weight"] = ("mlp.gate_up_proj.weight", (2 * ffn, hidden), ffn_keys)
        else:
            specs |= {"ffn_gate.weight": ("mlp.gate_proj.weight", (ffn, hidden), ffn_keys),
                      "ffn_up.weight": ("mlp.up_proj.weight", (ffn, hidden), ffn_keys)}
    if arch in GEMMA:
        specs |= {"post_attention_norm.weight": ("post_attention_layernorm.weight", *norm),
                  "ffn_norm.weight": ("pre_feedforward_layernorm.weight", *norm),
                  "post_ffw_norm.weight": ("post_feedforward_layernorm.weight", *norm)}
    elif arch in POST_ATTENTION_NORM:
        specs["post_attention_norm.weight"] = ("post_attention_layernorm.weight", *norm)
    else:
        specs["ffn_norm.weight"] = ("post_attention_layernorm.weight", *norm)
    if not recurrent:
        specs |= _attention_extras(f, d)
    return ({b + name: _spec(arch, d, m + hf, shape, keys) for name, (hf, shape, keys) in specs.items()}
            | {b + name: TensorSpec(hf, shape, keys, **opts)
               for name, (hf, shape, keys, opts) in (experts | mixer).items()})


def _attention(f: GGUFFile, d: Dims) -> dict[str, tuple]:
    """An attention layer's projections: GGUF name -> (Hugging Face name under the layer, shape in the file, the
    keys the shape comes from)."""
    a, arch = f.arch, f.architecture
    q, kv, hidden = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size
    q_keys, kv_keys = _head_keys(f)
    specs = {"attn_output.weight": ("self_attn.o_proj.weight", (hidden, q), q_keys)}
    if arch == "phi3":
        specs["attn_qkv.weight"] = ("self_attn.qkv_proj.weight", (q + 2 * kv, hidden), q_keys)
    else:
        gated = 2 if arch in HYBRID else 1             # each head's query, then its output gate
        specs |= {"attn_q.weight": ("self_attn.q_proj.weight", (gated * q, hidden), q_keys),
                  "attn_k.weight": ("self_attn.k_proj.weight", (kv, hidden), kv_keys),
                  "attn_v.weight": ("self_attn.v_proj.weight", (kv, hidden), kv_keys)}
    return specs


def _attention_extras(f: GGUFFile, d: Dims) -> dict[str, tuple]:
    """An attention layer's q/k norms, biases and sinks, as _attention gives them."""
    a, arch, specs = f.arch, f.architecture, {}
    q, kv, hidden = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size
    q_keys, kv_keys = _head_keys(f)
    if arch in QK_NORM:
        head = (d.head_dim,), a("attention.key_length")
        specs |= {"attn_q_norm.weight": ("self_attn.q_norm.weight", *head),
                  "attn_k_norm.weight": ("self_attn.k_norm.weight", *head)}
    if arch in QKV_BIAS:
        specs |= {"attn_q.bias": ("self_attn.q_proj.bias", (q,), q_keys),
                  "attn_k.bias": ("self_attn.k_proj.bias", (kv,), kv_keys),
                  "attn_v.bias": ("self_attn.v_proj.bias", (kv,), kv_keys)}
    if arch == "gpt-oss":
        specs |= {"attn_output.bias": ("self_attn.o_proj.bias", (hidden,), a("embedding_length")),
                  "attn_sinks.weight": ("self_attn.sinks", (d.num_heads,), a("attention.head_count"))}
    return specs


def _head_keys(f: GGUFFile) -> tuple[str, str]:
    """The metadata keys the shapes of q and of k / v come from, for errors."""
    a = f.arch
    return (f"{a('attention.head_count')}, {a('attention.key_length')}, {a('embedding_length')}",
            f"{a('attention.head_count_kv')}, {a('attention.key_length')}, {a('embedding_length')}")


def _spec(arch: str, d: Dims, hf_name: str, shape: tuple[int, ...], keys: str) -> TensorSpec:
    heads = None
    if arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = d.num_heads if hf_name.endswith("q_proj.weight") else d.num_kv_heads
    offset = 1.0 if arch in ZERO_CENTRED_NORMS and hf_name.endswith("norm.weight") else 0.0
    return TensorSpec(hf_name, shape, keys, heads, offset)
