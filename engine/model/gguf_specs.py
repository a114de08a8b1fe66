"""What the GGUF loader knows of a file before it reads a tensor: the model's dimensions, and each tensor's
Hugging Face name, shape and the conversions it needs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    hf_name: str
    shape: tuple[int, ...]                 # in the file, row-major: [out, in] (stacked experts: [experts, out, in])
    keys: str                              # the metadata keys the shape comes from, for errors
    unpermute_heads: int | None = None     # undo llama.cpp's Q/K row permutation over this many heads
    offset: float = 0.0                    # subtract: llama.cpp stores Gemma's and the hybrids' norms as 1 + weight
    experts: bool = False                  # one Hugging Face tensor per expert: hf_name.format(expert=e)
    transposed: bool = False               # Hugging Face stores it [.., in, out] (gpt-oss's experts)
    part: tuple[int, int] = (0, 1)         # (i, n): part i of n of the Hugging Face tensor: its n-th columns from i
    concatenated: bool = False             # ... or, instead, its i-th block of rows (the parts one after another)
    undo: tuple[Callable, ...] = ()        # applied in turn to the (joined) tensor: what the converter changed
