"""Every decoder layer of a decode step in one native call (kernels/csrc/decode_layers.cpp).

The per-op path calls ten kernels a layer from Python (RMSNorm, QKV, rotary + KV store, attention,
O, RMSNorm, gate-up, SiLU-and-mul, down), and at one row each call's Python (checks, allocation,
ctypes) costs about what its kernel does. This runs the same kernels in the same order from C++:
the same numbers, one call a step. It serves Llama-style layers with dense float32/bfloat16
weights, without q/k norms, at decode batches where the native linear beats BLAS for every
projection (`kernels.native_linear.prefer_native`); everything else keeps the per-op path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kernels.native import FLOAT, INT, POINTER, SUFFIXES, bind
from kernels.native_decode_attention import MAX_GROUP, MAX_HEAD_DIM, num_splits
from kernels.native_linear import MAX_NATIVE_ROWS, prefer_native

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
WEIGHTS_PER_LAYER = 10   # input norm, qkv (+ bias), o (+ bias), post norm, gate-up (+ bias), down (+ bias)


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """One decoder layer's parameters; a bias may be None."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    def pointers(self) -> list[int]:
        return [0 if t is None else t.data_ptr() for t in (
            self.input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, self.post_norm,
            self.gate_up, self.gate_up_bias, self.down, self.down_bias)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.input_norm, self.qkv, self.qkv_bias, self.o, self.o_bias, self.post_norm,
                                 self.gate_up, self.gate_up_bias, self.down, self.down_bias) if t is not None)


@dataclass(frozen=True, slots=True, eq=False)
class DecodeLayers:
    """A model's decoder layers as the native step takes them (a pointer table, built once)."""

    layers: tuple[LayerTensors, ...]
    table: torch.Tensor          # int64 [layers * WEIGHTS_PER_LAYER]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    _native_wins: dict[tuple[int, int], bool] = field(default_factory=dict)   # (row bucket, threads) ->

    @classmethod
    def build(cls, layers: list[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int,
              eps: float) -> DecodeLayers | None:
        """None when the native step cannot serve these layers (dtype, layout, head shape)."""
        if not layers or not _supported(layers, num_heads, num_kv_heads, head_dim):
            return None
        table = torch.tensor([p for layer in layers for p in layer.pointers()], dtype=torch.int64)
        return cls(tuple(layers), table, num_heads, num_kv_heads, head_dim, eps, head_dim ** -0.5)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].qkv.dtype

    @property
    def hidden(self) -> int:
        return self.layers[0].qkv.shape[1]

    @property
    def inner(self) -> int:
        return self.layers[0].down.shape[1]

    def serves(self, rows: int) -> bool:
        """Whether this step size goes native: every projection prefers the native linear at `rows`."""
        if not 0 < rows <= MAX_NATIVE_ROWS:
            return False
        key = (1 << (rows - 1).bit_length(), torch.get_num_threads())
        wins = self._native_wins.get(key)
        if wins is None:
            first = self.layers[0]
            wins = self._native_wins[key] = all(prefer_native(torch.zeros(key[0], w.shape[1], dtype=w.dtype), w)
                                                for w in (first.qkv, first.o, first.gate_up, first.down))
        return wins


def _supported(layers: list[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    dtype = layers[0].qkv.dtype
    tensors = [t for layer in layers for t in layer.tensors()]
    return (dtype in NATIVE_DTYPES and all(t.dtype == dtype and t.is_contiguous() and t.is_cpu for t in tensors)
            and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


@functools.cache
def _kernel(dtype: torch.dtype):
    return bind(f"pd_decode_layers_{SUFFIXES[str(dtype)]}", *[POINTER] * 12, FLOAT, FLOAT, INT)


def decode_layers_native(layers: DecodeLayers, h: torch.Tensor, kv_pool: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, cos_sin: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every layer over h [S, hidden] (the embeddings of one token per sequence); returns the
    last layer's output and the residual sum, as the per-op loop leaves them for the final norm."""
    seqs, hidden = h.shape
    _, num_layers, _, block_size, num_kv_heads, head_dim = kv_pool.shape
    _check(layers, h, kv_pool, positions, slot_mapping, cos_sin, block_tables, context_lens)
    threads = torch.get_num_threads()
    splits = num_splits(seqs, block_tables.shape[1] * block_size, threads)
    q_size, kv_size = layers.num_heads * head_dim, num_kv_heads * head_dim
    width = hidden + (q_size + 2 * kv_size) + 2 * q_size + 3 * layers.inner
    scratch = torch.empty(seqs * width, dtype=h.dtype)
    partials = torch.empty(seqs * layers.num_heads * splits * (head_dim + 1)) if splits > 1 else None
    out, residual = h.clone(), torch.empty_like(h)
    block, layer, kv, slot, head = kv_pool.stride()[:5]
    shape = torch.tensor([seqs, hidden, layers.num_heads, num_kv_heads, head_dim, layers.inner, num_layers,
                          splits, block_size, block, layer, kv, slot, head, block_tables.stride(0),
                          cos_sin.stride(0), 0], dtype=torch.int64)
    _kernel(h.dtype)(out.data_ptr(), residual.data_ptr(), layers.table.data_ptr(), shape.data_ptr(),
                     kv_pool.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(), cos_sin.data_ptr(),
                     block_tables.data_ptr(), context_lens.data_ptr(), scratch.data_ptr(),
                     None if partials is None else partials.data_ptr(), layers.eps, layers.scale, threads)
    return out, residual


def _check(layers: DecodeLayers, h: torch.Tensor, kv_pool: torch.Tensor, positions: torch.Tensor,
           slot_mapping: torch.Tensor, cos_sin: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor) -> None:
    seqs = h.shape[0]
    assert h.dtype == kv_pool.dtype == layers.dtype and h.is_contiguous() and h.shape[1] == layers.hidden
    assert kv_pool.is_contiguous() and kv_pool.shape[1] == len(layers.layers) and kv_pool.shape[5] == layers.head_dim
    assert kv_pool.shape[4] == layers.num_kv_heads
    assert positions.shape == slot_mapping.shape == context_lens.shape == (seqs,) and block_tables.shape[0] == seqs
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in (positions, slot_mapping, context_lens))
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == layers.head_dim and cos_sin.stride(1) == 1
