"""Models the simulator knows by name (no directory here): their dimensions as a ModelConfig."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig, RopeConfig
from pdserve.engine.model.config import ExpertsConfig, LayerKind


def named(name: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          head_dim: int, max_positions: int, eos: tuple[int, ...], rope_theta: float = 500000.0,
          experts: ExpertsConfig | None = None, architecture: str = "llama") -> ModelConfig:
    """A Llama-shaped model of these dimensions (every MLP a mixture of `experts` where given); its
    `model_dir` is its name (there is no directory)."""
    rope = RopeConfig(rope_theta)
    return ModelConfig(model_dir=Path(name), architecture=architecture,
                       vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=max_positions, rope=rope, attention_bias=False, qk_norm=False,
                       tie_word_embeddings=False, eos_token_ids=eos, checkpoint_dtype=torch.bfloat16,
                       layer_kinds=(LayerKind(0, rope, experts is not None),) * layers, experts=experts)


NAMED_SHAPES = {shape.name: shape for shape in (
    # meta-llama/Llama-3.1-8B config.json
    named("llama-8b", 128256, 4096, 14336, 32, 32, 8, 128, 131072, (128001,)),
    # meta-llama/Llama-2-13b-hf config.json (DistServe's OPT/Llama-13B comparisons)
    named("llama-13b", 32000, 5120, 13824, 40, 40, 40, 128, 4096, (2,)),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, top 2
    named("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, 128, 32768, (2,), 1e6, ExpertsConfig(8, 2, 14336),
          "mixtral"),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, top 8, renormalised
    named("qwen3-30b-a3b", 151936, 2048, 6144, 48, 32, 4, 128, 40960, (151645,), 1e6,
          ExpertsConfig(128, 8, 768), "qwen3_moe"),
)}
