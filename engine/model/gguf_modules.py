"""A projection and an embedding computed from GGUF weight blocks (a GGUFMatrix), with no float copy.

`GGUFLinear` multiplies up to `max_rows` rows straight from the blocks (activations quantized per
block, integer dot products) and larger batches through dequantized tiles (the start-up probe sets
where one is faster than the other). `GGUFEmbedding` gathers token rows from the blocks and
dequantizes them. Both serve CPU tensors through the native kernels and CUDA tensors through the
Triton ones.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.gguf_formats import GGUFMatrix
from pdserve.kernels.gguf_linear import gguf_gather, gguf_linear_native, gguf_linear_tiled
from pdserve.kernels.native_decode_layers import Projection


class GGUFLinear(nn.Module):
    """Drop-in for `Linear` over `matrix`, with the `bias` of the Linear it replaces (filled by the loader)."""

    def __init__(self, matrix: GGUFMatrix, bias: nn.Parameter | None, max_rows: int = 1) -> None:
        super().__init__()
        self.matrix = matrix
        self.bias = bias
        self.max_rows = max_rows

    @property
    def weight(self) -> torch.Tensor:
        """The first part's blocks (uint8): what identifies the weights (no float weight exists)."""
        return self.matrix.segments[0].data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pdserve.kernels.gguf_triton import gguf_linear_triton

            y = gguf_linear_triton(x, self.matrix)
        elif x.shape[0] <= self.max_rows:
            y = gguf_linear_native(x, self.matrix)
        else:
            y = gguf_linear_tiled(x, self.matrix)
        return y if self.bias is None else y.add_(self.bias)

    def native_projection(self) -> Projection:
        """This linear as the one-call decode step runs it (from the blocks, up to max_rows)."""
        return Projection(None, None if self.bias is None else self.bias.data, self.matrix, self.max_rows)

    def extra_repr(self) -> str:
        return f"{self.matrix.shape}, types={'+'.join(self.matrix.types)}, max_rows={self.max_rows}"


class GGUFEmbedding(nn.Module):
    """Drop-in for `Embedding` over `matrix` (one segment: the token table in its blocks)."""

    def __init__(self, matrix: GGUFMatrix, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        assert len(matrix.segments) == 1
        self.matrix = matrix
        self.register_buffer("weight", torch.empty(0, matrix.in_features, dtype=dtype, device=device),
                             persistent=False)   # NOTE: no values: the serving dtype and device the model reads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_cuda:
            from pdserve.kernels.gguf_triton import gguf_gather_triton

            return gguf_gather_triton(self.matrix.segments[0], ids, self.weight.dtype)
        return gguf_gather(self.matrix.segments[0], ids.reshape(-1), self.weight.dtype).reshape(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.matrix.shape}, type={self.matrix.types[0]}"
