"""Tiny checkpoints written by transformers itself, for parity tests (no hub access)."""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama3", "qwen2", "qwen3")


def make_hf_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a randomly initialised transformers model of `arch` to `out_dir`, in float32."""
    import transformers

    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, initializer_range=0.08)
    if arch == "llama3":
        config = transformers.LlamaConfig(
            **common, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _perturb_norms(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _perturb_norms(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
