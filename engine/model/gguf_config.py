"""What a GGUF file's metadata says the model is: its `config.json` (its tensors: gguf_tensors.py).

Llama, Qwen2, Qwen3, Gemma 2, Gemma 3, Gemma 4 (gguf_gemma4.py), Phi-3 and SmolLM3 architectures, the
mixture-of-experts ones (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss: gguf_experts.py) and the hybrid ones
(Qwen3-Next, Qwen3.5, Qwen3.5-MoE: gguf_hybrid.py), as llama.cpp's converter writes them and llama.cpp reads
them; the multi-token-prediction blocks after a model's layers (`nextn_predict_layers`) are not served. Keys
follow llama.cpp's names (`llama.embedding_length`, ...). What the file leaves to llama.cpp's model code is taken
from there: Gemma's sliding-window pattern (every 2nd / 6th layer global) and attention scale (head_dim, hidden /
heads for the 27B models), SmolLM3's every 4th layer without rotary embedding. Phi-3's sliding window is kept
(llama.cpp runs Phi-3 without it; transformers and vLLM with it).
"""
from __future__ import annotations

import math

import numpy as np

from pdserve.engine.model import gguf_gemma4
from pdserve.engine.model.gguf_experts import expert_config, expert_count, expert_ffn
from pdserve.engine.model.gguf_hybrid import HYBRID, hybrid_config
from pdserve.engine.model.gguf_reader import GGUFFile
from pdserve.engine.model.gguf_specs import Dims

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM",
                 "phi3": "Phi3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM"}
REFUSED: dict[str, str] = {}                   # architecture -> why a file of it cannot be served
ROPE_FREQS = "rope_freqs.weight"
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")
FOLDED = (ROPE_FREQS, *LONGROPE)               # tensors that are configuration: folded into config.json
GEMMA = ("gemma2", "gemma3")
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}   # llama.cpp's: every n-th layer global, the rest sliding
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}   # llama.cpp scales these by hidden / heads, others by head_dim
NO_ROPE_STEP = {"smollm3": 4}                  # llama.cpp: every n-th layer without rotary embedding


def read_dims(f: GGUFFile) -> Dims:
    """The model's dimensions; GGUFError naming the key for an unsupported or missing one."""
    if f.architecture in REFUSED:
        raise f.error(f"architecture {f.architecture!r} (general.architecture) cannot be served: "
                      f"{REFUSED[f.architecture]}; supported: {', '.join(ARCHITECTURES)}")
    if f.architecture not in ARCHITECTURES:
        raise f.error(f"unsupported architecture {f.architecture!r} (general.architecture); "
                      f"supported: {', '.join(ARCHITECTURES)}")
    hidden, heads = f.integer(f.arch("embedding_length")), f.integer(f.arch("attention.head_count"))
    vocab = f.integer(f.arch("vocab_size")) if f.arch("vocab_size") in f else len(f.strings("tokenizer.ggml.tokens"))
    if f.architecture == "gemma4":
        return gguf_gemma4.dims(f, vocab)
    head_dim = _head_dim(f, hidden, heads)
    return Dims(vocab_size=vocab,
                hidden_size=hidden, intermediate_size=_dense_ffn(f),
                num_layers=_served_layers(f), num_heads=heads,
                num_kv_heads=_kv_heads(f, heads), head_dim=head_dim, rotary_dim=_rotary_dim(f, head_dim))


def _dense_ffn(f: GGUFFile) -> int:
    """feed_forward_length; an expert's size in a file with experts and none (Qwen3.5-MoE: every MLP is experts)."""
    key = f.arch("feed_forward_length")
    return f.integer(key) if key in f or not expert_count(f) else expert_ffn(f)


def _served_layers(f: GGUFFile) -> int:
    """block_count less the multi-token-prediction blocks that follow the model's layers."""
    blocks, mtp = f.integer(f.arch("block_count")), f.integer(f.arch("nextn_predict_layers"), 0)
    if not 0 <= mtp < blocks:
        raise f.error(f"{f.arch('nextn_predict_layers')} = {mtp} leaves no layer of {f.arch('block_count')} = {blocks}")
    return blocks - mtp


def hf_config(f: GGUFFile, d: Dims, folded: dict[str, np.ndarray], special_ids: dict[str, int | None]) -> dict:
    """config.json as transformers writes it for this model (float32: the dequantized values are exact there).
    `folded`: the tensors that are configuration (rope_freqs.weight, LongRoPE's factors), by name."""
    a = f.arch
    config = {
        "architectures": [ARCHITECTURES[f.architecture]], "model_type": f.architecture,
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size, "num_hidden_layers": d.num_layers,
        "num_attention_heads": d.num_heads, "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim,
        "vocab_size": d.vocab_size, "hidden_act": "silu",
        "rms_norm_eps": f.number(a("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": f.integer(a("context_length")),
        "rope_theta": f.number(a("rope.freq_base"), 10000.0),
        "rope_scaling": None if f.architecture == "gemma4" else rope_scaling(f, d, folded),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": special_ids.get("bos"), "eos_token_id": special_ids.get("eos"),
        "torch_dtype": "float32", "use_cache": True,
    }
    if d.rotary_dim != d.head_dim:
        config["partial_rotary_factor"] = d.rotary_dim / d.head_dim
    if f.architecture == "gemma4":
        return config | gguf_gemma4.config(f, d, folded.get(ROPE_FREQS))
    return config | _family(f, d) | expert_config(f, d)


def _family(f: GGUFFile, d: Dims) -> dict:
    """The keys of config.json only some families have: windows, soft-caps, norms' scale, per-layer rotary."""
    arch, window = f.architecture, f.value(f.arch("attention.sliding_window"), 0)
    if arch == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        return {"use_sliding_window": False, "sliding_window": None}
    if arch in HYBRID:
        return hybrid_config(f, d.num_layers)
    if arch == "gpt-oss":                              # NOTE: transformers' YaRN for gpt-oss does not truncate
        return {"sliding_window": window, "layer_types": _layer_types(f, d), "attention_bias": True,
                "rope_scaling": (rope_scaling(f, d, {}) or {"rope_type": "default"}) | {"truncate": False}}
    if arch == "smollm3":
        step = NO_ROPE_STEP[arch]
        return {"no_rope_layers": [int((i + 1) % step != 0) for i in range(d.num_layers)], "use_sliding_window": False}
    if arch == "phi3":
        return {"sliding_window": window or None,
                "original_max_position_embeddings": f.integer(f.arch("rope.scaling.original_context_length"),
                                                              f.integer(f.arch("context_length")))}
    big = d.num_layers == GEMMA_27B_LAYERS[arch]
    config = {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": window or 4096,
              "layer_types": _layer_types(f, d), "attention_bias": False,
              "query_pre_attn_scalar": d.hidden_size // d.num_heads if big else d.head_dim,
              "final_logit_softcapping": f.value(f.arch("final_logit_softcapping"))}
    if arch == "gemma2":
        return config | {"attn_logit_softcapping": f.value(f.arch("attn_logit_softcapping"))}
    local = {"rope_type": "default", "rope_theta": f.number(f.arch("rope.freq_base_swa"), 10000.0)}
    scaling = rope_scaling(f, d, {}) or {"rope_type": "default"}
    full = {"rope_theta": f.number(f.arch("rope.freq_base"), 1e6), **scaling}
    return config | {"attn_logit_softcapping": None, "rope_scaling": None,
                     "rope_parameters": {"sliding_attention": local, "full_attention": full}}


def _layer_types(f: GGUFFile, d: Dims) -> list[str]:
    """llama.cpp's sliding-window pattern: a per-layer array, an every-n-th-layer-global count, or the family's."""
    key = f.arch("attention.sliding_window_pattern")
    pattern = f.value(key, SWA_PATTERN[f.architecture])
    if isinstance(pattern, list):
        if len(pattern) != d.num_layers:
            raise f.error(f"{key} lists {len(pattern)} layers for {f.arch('block_count')} = {d.num_layers}")
        return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    if not isinstance(pattern, int) or pattern < 1:
        raise f.error(f"{key} = {pattern!r} is neither a per-layer list nor a positive count")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(d.num_layers)]


def rope_scaling(f: GGUFFile, d: Dims, folded: dict[str, np.ndarray]) -> dict | None:
    """`rope_scaling` from `rope.scaling.*`, LongRoPE's from its factor tensors, or Llama 3's from the
    per-frequency factors in rope_freqs.weight."""
    key = f.arch("rope.scaling.type")
    kind = f.string(key, "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": f.number(f.arch("rope.scaling.factor"))}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": f.number(f.arch("rope.scaling.factor")),
                "original_max_position_embeddings": f.integer(f.arch("rope.scaling.original_context_length")),
                "beta_fast": f.number(f.arch("rope.scaling.yarn_beta_fast"), 32.0),
                "beta_slow": f.number(f.arch("rope.scaling.yarn_beta_slow"), 1.0)}
    if kind != "none":
        raise f.error(f"{key} = {kind!r} is not supported (linear, yarn, LongRoPE's factor tensors, or Llama 3's "
                      f"rope_freqs.weight)")
    if all(name in folded for name in LONGROPE):
        return _longrope(f, d, folded)
    rope_freqs = folded.get(ROPE_FREQS)
    if rope_freqs is None or np.allclose(rope_freqs, 1.0):
        return None
    return _llama3_scaling(f, rope_freqs, f.number(f.arch("rope.freq_base"), 10000.0), d.head_dim)


def _longrope(f: GGUFFile, d: Dims, folded: dict[str, np.ndarray]) -> dict:
    long, short = (folded[name] for name in LONGROPE)
    if long.shape != short.shape or long.shape != (d.rotary_dim // 2,):
        raise f.error(f"{LONGROPE[0]} and {LONGROPE[1]} must hold {d.rotary_dim // 2} factors "
                      f"({f.arch('rope.dimension_count')} / 2), got {long.size} and {short.size}")
    scaling = {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
    factor = f.value(f.arch("rope.scaling.attn_factor"))
    return scaling if factor is None else scaling | {"attention_factor": float(factor)}


def _llama3_scaling(f: GGUFFile, factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Recover (factor, low/high_freq_factor, original context) from llama.cpp's rope_freqs factors.

    Between the two cut-offs Llama 3 blends linearly in frequency: 1/r = (1-s)/factor + s with
    s = A*freq - B. Two or more blended frequencies fix A and B; the context length only scales them.
    """
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    blended = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if factors.shape != freqs.shape or blended.sum() < 2:
        raise f.error(f"{ROPE_FREQS} ({factors.size} factors) does not follow Llama 3's rope scaling")
    s = (1.0 / factors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(freqs[blended], s, 1)
    low, high = 1.0, 1.0 - 1.0 / intercept                # low_freq_factor 1: B = 1 / (high - low)
    original = round(2 * math.pi * slope * (high - low))
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": original}
    if intercept >= 0 or not np.allclose(llama3_factors(scaling, freqs), factors, rtol=1e-4):
        raise f.error(f"{ROPE_FREQS} does not follow Llama 3's rope scaling")
    return scaling


def llama3_factors(scaling: dict, freqs: np.ndarray) -> np.ndarray:
    """The factors llama.cpp's converter writes into rope_freqs.weight for a Llama 3 `rope_scaling`."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _kv_heads(f: GGUFFile, heads: int) -> int:
    key = f.arch("attention.head_count_kv")
    value = f.value(key, heads)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise f.error(f"{key}: a different KV head count per layer is not supported")
        value = value[0]
    if not isinstance(value, int) or value <= 0 or heads % value:
        raise f.error(f"{key} = {value!r} does not divide {f.arch('attention.head_count')} = {heads}")
    return value


def _head_dim(f: GGUFFile, hidden: int, heads: int) -> int:
    rope_dim = f.value(f.arch("rope.dimension_count"))
    key_length = f.value(f.arch("attention.key_length"))
    head_dim = key_length or (rope_dim if f.architecture == "llama" else None) or hidden // heads
    if not key_length and not rope_dim and hidden % heads:
        raise f.error(f"{f.arch('embedding_length')} = {hidden} is not a multiple of "
                      f"{f.arch('attention.head_count')} = {heads}")
    if f.value(f.arch("attention.value_length"), head_dim) != head_dim:
        raise f.error(f"{f.arch('attention.value_length')} differs from the key length {head_dim}: not supported")
    return head_dim


def _rotary_dim(f: GGUFFile, head_dim: int) -> int:
    """The rotated part of each head: rope.dimension_count (Phi-4-mini rotates 3/4 of it), else all of it."""
    key = f.arch("rope.dimension_count")
    rope_dim = f.value(key, head_dim)
    if not isinstance(rope_dim, int) or rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise f.error(f"{key} = {rope_dim!r}: a rotary embedding must cover an even part of the head ({head_dim})")
    return rope_dim
