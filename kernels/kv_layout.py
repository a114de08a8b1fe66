"""The paged KV pool's memory layout, in one place: everything that allocates, sizes, copies or reads
a pool goes through `KVLayout`, so a layout change is one edit.

pool: [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim], contiguous. A block
holds every layer's K and V for `block_size` consecutive tokens, so a run of consecutive block ids
is one contiguous memory range (one copy per run; DistServe's layout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


class PoolStrides(NamedTuple):
    """Element strides of a pool, as the Triton kernels take them (the head_dim stride is 1)."""

    block: int
    layer: int
    kv: int
    slot: int
    head: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, pool: torch.Tensor) -> KVLayout:
        """The layout of an existing pool; ValueError when the tensor is not shaped like one."""
        if pool.dim() != 6 or pool.shape[2] != 2:
            raise ValueError(f"not a KV pool [blocks, layers, 2, block_size, kv_heads, head_dim]: "
                             f"shape {tuple(pool.shape)}")
        _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
        return cls(num_layers, block_size, num_kv_heads, head_dim)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_elements(self) -> int:
        return math.prod(self.shape(1))

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.block_elements * torch.empty((), dtype=dtype).element_size()

    def allocate(self, num_blocks: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.shape(num_blocks), dtype=dtype, device=device)

    @staticmethod
    def num_blocks(pool: torch.Tensor) -> int:
        return pool.shape[0]

    @staticmethod
    def layer(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V: each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return pool[:, layer, 0], pool[:, layer, 1]

    @staticmethod
    def block_view(pool: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Blocks first .. first + count - 1: one contiguous range."""
        return pool[first:first + count]

    @staticmethod
    def strides(pool: torch.Tensor) -> PoolStrides:
        assert pool.stride(5) == 1, "the head_dim of a KV pool must be contiguous"
        return PoolStrides(*(pool.stride(i) for i in range(5)))
