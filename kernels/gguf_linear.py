"""y = x @ W^T for W in GGUF blocks (a GGUFMatrix), on CPU: kernels/csrc/gguf_linear.cpp and gguf_dequantize.cpp.

`gguf_linear_native` computes from the blocks: x (float32 or bfloat16) quantized per block as llama.cpp
does (q8 for 32-weight blocks, q8_K for the K types), integer dot products inside each block, float32
across blocks, y in x's dtype. `gguf_linear_tiled` is the prefill-sized alternative: a tile of rows at a
time dequantized into x's dtype, multiplied by torch (oneDNN / BLAS), so no dense copy of the weight is
kept. `gguf_dequantize_native` gathers rows (the embedding). The reference is
`gguf_formats.dequantize_reference` followed by a float64 matmul.
"""
from __future__ import annotations

import functools

import torch

from pdserve.kernels.gguf_formats import TYPES, GGUFMatrix, Segment
from pdserve.kernels.native import INT, INT64, POINTER, bind, cpu_kernels

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
TILE_BYTES = 4 << 20          # a dequantized tile: a few MiB, so it stays in the caches the matmul reads


def native_available() -> bool:
    """True when the C++ kernels are built (or build now) for this CPU."""
    return cpu_kernels() is not None


@functools.cache
def _linear():
    function = bind("pd_gguf_linear", POINTER, INT64, INT64, POINTER, INT, INT64, POINTER, INT)
    function.restype = INT
    return function


@functools.cache
def _dequantize():
    function = bind("pd_gguf_dequantize", INT64, POINTER, INT64, POINTER, INT64, INT64, INT64, POINTER, INT, INT)
    function.restype = INT
    return function


def supports(matrix: GGUFMatrix, x_dtype: torch.dtype) -> bool:
    """Whether the native kernels take this matrix with activations of `x_dtype`."""
    return x_dtype in ACTIVATION_DTYPES and all(s.type in TYPES for s in matrix.segments)


def gguf_linear_native(x: torch.Tensor, matrix: GGUFMatrix, threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32/bfloat16 on CPU -> [M, N] in x's dtype, computed from the blocks."""
    x = _checked(x, matrix)
    y = torch.empty(x.shape[0], matrix.out_features, dtype=x.dtype)
    if x.shape[0] == 0:
        return y
    status = _linear()(matrix.table.data_ptr(), len(matrix.segments), matrix.in_features, x.data_ptr(),
                       int(x.dtype == torch.bfloat16), x.shape[0], y.data_ptr(), threads or torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"gguf_linear: kernel refused {matrix.types} {matrix.shape} x {tuple(x.shape)}")
    return y


def gguf_linear_tiled(x: torch.Tensor, matrix: GGUFMatrix, threads: int | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N]: each tile of rows dequantized into x's dtype and multiplied by torch."""
    x = _checked(x, matrix)
    y = torch.empty(x.shape[0], matrix.out_features, dtype=x.dtype)
    rows_per_tile = max(1, TILE_BYTES // (matrix.in_features * x.element_size()))
    tile = torch.empty(min(rows_per_tile, matrix.out_features), matrix.in_features, dtype=x.dtype)
    column = 0
    for segment in matrix.segments:
        for first in range(0, segment.rows, rows_per_tile):
            count = min(rows_per_tile, segment.rows - first)
            part = dequantize_rows(segment, first, count, tile[:count], threads)
            if count == matrix.out_features:                        # NOTE: one tile: no temporary
                torch.mm(x, part.t(), out=y)
            else:
                y[:, column + first:column + first + count] = torch.mm(x, part.t())
        column += segment.rows
    return y


def dequantize_rows(segment: Segment, first: int, count: int, out: torch.Tensor, threads: int | None = None
                    ) -> torch.Tensor:
    """Rows [first, first + count) of `segment` into `out` ([count, K] float32/bfloat16); returns `out`."""
    assert 0 <= first and first + count <= segment.rows and out.shape == (count, segment.in_features)
    _run_dequantize(segment, None, first, count, out, threads)
    return out


def gguf_gather(segment: Segment, ids: torch.Tensor, dtype: torch.dtype, threads: int | None = None
                ) -> torch.Tensor:
    """Rows `ids` (int64 [T], each within the segment) of `segment`, dequantized: [T, K] in `dtype`."""
    assert dtype in ACTIVATION_DTYPES
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= segment.rows):
        raise IndexError(f"row ids must lie in [0, {segment.rows})")
    out = torch.empty(ids.numel(), segment.in_features, dtype=dtype)
    _run_dequantize(segment, ids, 0, ids.numel(), out, threads)
    return out


def _run_dequantize(segment: Segment, ids: torch.Tensor | None, first: int, count: int, out: torch.Tensor,
                    threads: int | None) -> None:
    assert out.dtype in ACTIVATION_DTYPES and out.is_contiguous() and segment.data.device.type == "cpu"
    status = _dequantize()(TYPES[segment.type].ggml, segment.data.data_ptr(), segment.data.stride(0),
                           None if ids is None else ids.data_ptr(), first, count, segment.in_features,
                           out.data_ptr(), int(out.dtype == torch.bfloat16), threads or torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"gguf_dequantize: kernel refused {segment.type} x {segment.in_features}")


def _checked(x: torch.Tensor, matrix: GGUFMatrix) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] == matrix.in_features and x.device.type == "cpu", (x.shape, matrix.shape)
    assert supports(matrix, x.dtype), (matrix.types, x.dtype)
    return x.contiguous()
