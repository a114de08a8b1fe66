"""Models the simulator knows by name (no directory here): their dimensions as a ModelConfig."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig, RopeConfig


def named(name: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          head_dim: int, max_positions: int, eos: tuple[int, ...]) -> ModelConfig:
    """A Llama-shaped model of these dimensions; its `model_dir` is its name (there is no directory)."""
    return ModelConfig(Path(name), "llama", vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, 1e-5,
                       max_positions, RopeConfig(500000.0), False, False, False, None, eos, torch.bfloat16)


NAMED_SHAPES = {shape.name: shape for shape in (
    # meta-llama/Llama-3.1-8B config.json
    named("llama-8b", 128256, 4096, 14336, 32, 32, 8, 128, 131072, (128001,)),
    # meta-llama/Llama-2-13b-hf config.json (DistServe's OPT/Llama-13B comparisons)
    named("llama-13b", 32000, 5120, 13824, 40, 40, 40, 128, 4096, (2,)),
)}
