"""The built-in demo checkpoint: random Llama / Qwen2 weights in the Hugging Face layout.

Generated locally and deterministically from a seed; no hub access. The weights are
scaled so that logits are well separated (std ~3) and activations stay finite over
the whole context window.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.engine.model import demo_corpus
from pdserve.engine.model.cache import build_once, cache_root
from pdserve.engine.model.demo_corpus import ENDOFTEXT, IM_END, SPECIAL_TOKENS

ARCHS = ("llama", "qwen2")
LOGIT_STD = 3.0
NORM_NOISE = 0.05
BIAS_STD = 0.1
BRANCH_GAIN = 4.0  # attention / MLP outputs vs the embedding scale: context must matter


@dataclass(frozen=True, slots=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SIZES = {
    "tiny": DemoSize(128, 2, 4, 2, 256, 1024, 4096, torch.float32),
    "base": DemoSize(768, 12, 12, 4, 1792, 8192, 8192, torch.bfloat16),
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def make_model(out_dir: str | Path, size: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Write a complete demo checkpoint into `out_dir` (created if missing) and return its path.

    Same (size, arch, seed) gives byte-identical files. Raises ValueError on an unknown size or arch.
    """
    spec = _size(size)
    if arch not in ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; choose one of {ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(spec, arch)
    save_file(make_weights(config, spec.dtype, seed), out / "model.safetensors", metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(_tokenizer_json(spec.vocab_size), encoding="utf-8")
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", demo_corpus.tokenizer_config())
    _write_json(out / "generation_config.json", _generation_config())
    return out


def default_model_dir(size: str = "tiny", arch: str = "llama") -> Path:
    """The cached demo checkpoint for (size, arch, seed 0), generated on first use.

    Lives in the cache folder (`pdserve.engine.model.cache`) as demo-<size>-<arch>-s0; concurrent callers are safe.
    """
    return build_once(cache_root() / f"demo-{size}-{arch}-s0", lambda tmp: make_model(tmp, size, arch, seed=0))


def model_config(spec: DemoSize, arch: str) -> dict:
    """config.json as transformers writes it for this size and arch."""
    common = {
        "attention_dropout": 0.0,
        "bos_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": 1e-5,
        "torch_dtype": _DTYPE_NAMES[spec.dtype],
        "dtype": _DTYPE_NAMES[spec.dtype],
        "transformers_version": "4.46.0",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "attention_bias": False, "eos_token_id": _eos_ids(), "head_dim": spec.head_dim,
                "mlp_bias": False, "pretraining_tp": 1, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
                "tie_word_embeddings": False}
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
            "eos_token_id": _eos_ids()[0], "max_window_layers": spec.num_layers, "rope_theta": 1000000.0,
            "rope_scaling": None, "sliding_window": None, "tie_word_embeddings": True,
            "use_sliding_window": False}


def make_weights(config: dict, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face tensor names, drawn in a fixed order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    residual_std = LOGIT_STD / hidden ** 0.5  # NOTE: tied lm_head = embeddings, so the stream shares its scale

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    def norm_weight() -> torch.Tensor:
        return (1.0 + torch.randn(hidden, generator=gen) * NORM_NOISE).to(dtype)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=residual_std)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        for name, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            weights[p + f"self_attn.{name}_proj.weight"] = normal(rows, hidden, std=hidden ** -0.5)
            if config["model_type"] == "qwen2":
                weights[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=BIAS_STD)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim, std=residual_std * BRANCH_GAIN / q_dim ** 0.5)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden ** -0.5)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=hidden ** -0.5)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=residual_std * BRANCH_GAIN / inter ** 0.5)
    weights["model.norm.weight"] = norm_weight()
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(vocab, hidden, std=residual_std)
    return weights


def num_parameters(config: dict) -> int:
    """Parameter count implied by a demo config (tied embeddings counted once)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attn = 2 * hidden * q_dim + 2 * hidden * kv_dim
    if config["model_type"] == "qwen2":
        attn += q_dim + 2 * kv_dim
    layer = attn + 3 * hidden * inter + 2 * hidden
    heads = 1 if config["tie_word_embeddings"] else 2
    return config["num_hidden_layers"] * layer + heads * vocab * hidden + hidden


def _size(size: str) -> DemoSize:
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; choose one of {tuple(SIZES)}")
    return SIZES[size]


def _eos_ids() -> list[int]:
    return [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)]


def _generation_config() -> dict:
    return {"bos_token_id": SPECIAL_TOKENS.index(ENDOFTEXT), "eos_token_id": _eos_ids(),
            "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT), "transformers_version": "4.46.0"}


@lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    return demo_corpus.tokenizer_json(vocab_size)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
