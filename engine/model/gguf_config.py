"""What a GGUF file's metadata says the model is: its `config.json` (its tensors: gguf_tensors.py).

Llama and Qwen2 architectures. Keys follow llama.cpp's names (`llama.embedding_length`, ...);
tensor names its `blk.N.attn_q.weight` scheme. llama.cpp's converter permutes the rows of a Llama
model's Q and K projections (for its rotary layout); `TensorSpec.unpermute_heads` says how to undo it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.engine.model.gguf_reader import GGUFFile

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True, slots=True)
class Dims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    hf_name: str
    shape: tuple[int, ...]                 # as Hugging Face stores it: [out, in]
    keys: str                              # the metadata keys the shape comes from, for errors
    unpermute_heads: int | None = None     # undo llama.cpp's Q/K row permutation over this many heads


def read_dims(f: GGUFFile) -> Dims:
    """The model's dimensions; GGUFError naming the key for an unsupported or missing one."""
    if f.architecture not in ARCHITECTURES:
        raise f.error(f"unsupported architecture {f.architecture!r} (general.architecture); "
                      f"supported: {', '.join(ARCHITECTURES)}")
    hidden, heads = f.integer(f.arch("embedding_length")), f.integer(f.arch("attention.head_count"))
    vocab = f.integer(f.arch("vocab_size")) if f.arch("vocab_size") in f else len(f.strings("tokenizer.ggml.tokens"))
    return Dims(vocab_size=vocab,
                hidden_size=hidden, intermediate_size=f.integer(f.arch("feed_forward_length")),
                num_layers=f.integer(f.arch("block_count")), num_heads=heads,
                num_kv_heads=_kv_heads(f, heads), head_dim=_head_dim(f, hidden, heads))


def hf_config(f: GGUFFile, d: Dims, rope_freqs: np.ndarray | None, special_ids: dict[str, int | None]) -> dict:
    """config.json as transformers writes it for this model (float32: the dequantized values are exact there)."""
    a = f.arch
    config = {
        "architectures": [ARCHITECTURES[f.architecture]], "model_type": f.architecture,
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size, "num_hidden_layers": d.num_layers,
        "num_attention_heads": d.num_heads, "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim,
        "vocab_size": d.vocab_size, "hidden_act": "silu",
        "rms_norm_eps": f.number(a("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": f.integer(a("context_length")),
        "rope_theta": f.number(a("rope.freq_base"), 10000.0),
        "rope_scaling": rope_scaling(f, d, rope_freqs),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": special_ids.get("bos"), "eos_token_id": special_ids.get("eos"),
        "torch_dtype": "float32", "use_cache": True,
    }
    if f.architecture == "llama":
        return config | {"attention_bias": False, "mlp_bias": False}
    return config | {"use_sliding_window": False, "sliding_window": None}


def rope_scaling(f: GGUFFile, d: Dims, rope_freqs: np.ndarray | None) -> dict | None:
    """`rope_scaling` from `rope.scaling.*`, or Llama 3's from the per-frequency factors in rope_freqs.weight."""
    key = f.arch("rope.scaling.type")
    kind = f.string(key, "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": f.number(f.arch("rope.scaling.factor"))}
    if kind != "none":
        raise f.error(f"{key} = {kind!r} is not supported (linear, or Llama 3's rope_freqs.weight)")
    if rope_freqs is None or np.allclose(rope_freqs, 1.0):
        return None
    return _llama3_scaling(f, rope_freqs, f.number(f.arch("rope.freq_base"), 10000.0), d.head_dim)


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
    if rope_dim is not None and rope_dim != head_dim:
        raise f.error(f"{f.arch('rope.dimension_count')} = {rope_dim}: rotary embedding over part of "
                      f"the head ({head_dim}) is not supported")
    return head_dim
