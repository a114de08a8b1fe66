"""y = x @ W^T for W in GGUF blocks (a GGUFMatrix) on CUDA: Triton kernels that dequantize as they multiply.

Each program computes a [BLOCK_M, BLOCK_N] tile of y, walking K 32 weights at a time (one block of the
32-weight types, one sub-block of the K types): the weights of its BLOCK_N rows are decoded from their
bytes (`_dequantize`, the arithmetic of gguf.quants: exact in float32) and multiplied by the
activations with `tl.dot` in float32 accumulators (bf16 / fp16 operands on a GPU, float32 under the
interpreter). Activations are not quantized: the result is the dequantized matmul up to float
rounding. A fused projection's segments are launched one after another into their columns of y.
`gguf_gather_triton` dequantizes embedding rows by token id. The references are
`gguf_formats.dequantize_reference` and a float64 matmul.
"""
from __future__ import annotations

import torch

from pdserve.kernels._triton import INTERPRETED, jit, tl
from pdserve.kernels.gguf_formats import TYPES, GGUFMatrix, Segment

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
STEP = 32                                     # weights decoded at a time along K
_tables: dict[torch.device, torch.Tensor] = {}


@jit
def _byte(p, offset):
    return tl.load(p + offset).to(tl.int32)


@jit
def _half(p, offset):
    bits = _byte(p, offset) | (_byte(p, offset + 1) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _scale_min_k4(p, j):
    """Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 bytes at p (ggml's get_scale_min_k4)."""
    low = j < 4
    jj = tl.where(low, j, j - 4)
    scale = tl.where(low, _byte(p, jj) & 63, (_byte(p, jj + 8) & 15) | ((_byte(p, jj) >> 6) << 4))
    minimum = tl.where(low, _byte(p, jj + 4) & 63, (_byte(p, jj + 8) >> 4) | ((_byte(p, jj + 4) >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@jit
def _dequantize(row, k, table, TYPE: tl.constexpr, BLOCK: tl.constexpr, BYTES: tl.constexpr):
    """The float32 weights at positions k (any shape) of the rows starting at byte pointers `row`."""
    b = row + (k // BLOCK) * BYTES
    i = k % BLOCK
    if TYPE == 8:                                                          # Q8_0
        w = _half(b, 0) * tl.load((b + 2 + i).to(tl.pointer_type(tl.int8))).to(tl.float32)
    elif TYPE == 2:                                                        # Q4_0
        w = _half(b, 0) * (((_byte(b, 2 + i % 16) >> ((i // 16) * 4)) & 15) - 8).to(tl.float32)
    elif TYPE == 3:                                                        # Q4_1
        w = _half(b, 0) * ((_byte(b, 4 + i % 16) >> ((i // 16) * 4)) & 15).to(tl.float32) + _half(b, 2)
    elif TYPE == 20:                                                       # IQ4_NL
        w = _half(b, 0) * tl.load(table + ((_byte(b, 2 + i % 16) >> ((i // 16) * 4)) & 15)).to(tl.float32)
    elif TYPE == 6:                                                        # Q5_0
        q = ((_byte(b, 6 + i % 16) >> ((i // 16) * 4)) & 15) | (((_byte(b, 2 + i // 8) >> (i % 8)) & 1) << 4)
        w = _half(b, 0) * (q - 16).to(tl.float32)
    elif TYPE == 7:                                                        # Q5_1
        q = ((_byte(b, 8 + i % 16) >> ((i // 16) * 4)) & 15) | (((_byte(b, 4 + i // 8) >> (i % 8)) & 1) << 4)
        w = _half(b, 0) * q.to(tl.float32) + _half(b, 2)
    elif TYPE == 12:                                                       # Q4_K
        j = i // 32
        q = (_byte(b, 16 + 32 * (j // 2) + i % 32) >> ((j % 2) * 4)) & 15
        scale, minimum = _scale_min_k4(b + 4, j)
        w = (_half(b, 0) * scale) * q.to(tl.float32) - _half(b, 2) * minimum
    elif TYPE == 13:                                                       # Q5_K
        j = i // 32
        q = (_byte(b, 48 + 32 * (j // 2) + i % 32) >> ((j % 2) * 4)) & 15
        q = q | (((_byte(b, 16 + i % 32) >> j) & 1) << 4)
        scale, minimum = _scale_min_k4(b + 4, j)
        w = (_half(b, 0) * scale) * q.to(tl.float32) - _half(b, 2) * minimum
    elif TYPE == 14:                                                       # Q6_K
        half = i // 128
        g = (i % 128) // 32
        lane = i % 32
        low = (_byte(b, 64 * half + 32 * (g % 2) + lane) >> ((g // 2) * 4)) & 15
        q = low | (((_byte(b, 128 + 32 * half + lane) >> (2 * g)) & 3) << 4)
        scale = tl.load((b + 192 + 8 * half + 2 * g + lane // 16).to(tl.pointer_type(tl.int8))).to(tl.float32)
        w = (_half(b, 208) * scale) * (q - 32).to(tl.float32)
    else:                                                                  # IQ4_XS
        j = i // 32
        lane = i % 32
        nibble = (_byte(b, 8 + 16 * j + lane % 16) >> ((lane // 16) * 4)) & 15
        high = ((_byte(b, 2) | (_byte(b, 3) << 8)) >> (2 * j)) & 3
        scale = (((_byte(b, 4 + j // 2) >> (4 * (j % 2))) & 15) | (high << 4)) - 32
        w = (_half(b, 0) * scale.to(tl.float32)) * tl.load(table + nibble).to(tl.float32)
    return w


@jit(do_not_specialize=("M", "N", "K", "column"))
def _matmul_kernel(x_ptr, w_ptr, table, y_ptr, M, N, K, stride_x, stride_w, stride_y, column,
                   TYPE: tl.constexpr, BLOCK: tl.constexpr, BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_FLOAT32: tl.constexpr):
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, 32)
    row = w_ptr + tl.where(rows_n < N, rows_n, 0).to(tl.int64)[:, None] * stride_w     # [BLOCK_N, 1] pointers
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_ptr + rows_m[:, None].to(tl.int64) * stride_x + (k0 + lanes)[None, :],
                    mask=rows_m[:, None] < M, other=0.0)                           # x: [BLOCK_M, 32]
        w = _dequantize(row, (k0 + lanes)[None, :], table, TYPE, BLOCK, BYTES)    # w: [BLOCK_N, 32] float32
        if DOT_FLOAT32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rows_m[:, None].to(tl.int64) * stride_y + column + rows_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(rows_m[:, None] < M) & (rows_n[None, :] < N))


@jit(do_not_specialize=("K",))
def _gather_kernel(ids, w_ptr, table, out_ptr, K, stride_w, TYPE: tl.constexpr, BLOCK: tl.constexpr,
                   BYTES: tl.constexpr, CHUNK: tl.constexpr):
    token = tl.program_id(0)
    k = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    row = w_ptr + tl.load(ids + token).to(tl.int64) * stride_w
    w = _dequantize(row, tl.where(k < K, k, 0), table, TYPE, BLOCK, BYTES)
    tl.store(out_ptr + token.to(tl.int64) * K + k, w.to(out_ptr.dtype.element_ty), mask=k < K)


def _table(device: torch.device) -> torch.Tensor:
    if device not in _tables:
        _tables[device] = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=device)
    return _tables[device]


def gguf_linear_triton(x: torch.Tensor, matrix: GGUFMatrix, block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) @ dequantize(matrix)^T -> [M, N] in x's dtype; blocks on x's device."""
    assert x.dim() == 2 and x.shape[1] == matrix.in_features and x.stride(1) == 1, (x.shape, matrix.shape)
    assert all(s.data.device == x.device and s.type not in ("F32", "F16", "BF16") for s in matrix.segments)
    y = torch.empty(x.shape[0], matrix.out_features, dtype=x.dtype, device=x.device)
    column = 0
    for segment in matrix.segments:
        kind = TYPES[segment.type]
        grid = (-(-x.shape[0] // block_m), -(-segment.rows // block_n))
        if x.shape[0]:
            _matmul_kernel[grid](x, segment.data, _table(x.device), y, x.shape[0], segment.rows, matrix.in_features,
                                 x.stride(0), segment.data.stride(0), y.stride(0), column, TYPE=kind.ggml,
                                 BLOCK=kind.block, BYTES=kind.bytes, BLOCK_M=block_m, BLOCK_N=block_n,
                                 DOT_FLOAT32=INTERPRETED or x.dtype == torch.float32)
        column += segment.rows
    return y


def gguf_gather_triton(segment: Segment, ids: torch.Tensor, dtype: torch.dtype, chunk: int = 256) -> torch.Tensor:
    """Rows `ids` of `segment` dequantized: [*ids.shape, K] in `dtype`, on the blocks' device."""
    kind, flat = TYPES[segment.type], ids.reshape(-1).to(torch.int64)
    assert segment.type not in ("F32", "F16", "BF16") and flat.device == segment.data.device
    out = torch.empty(flat.numel(), segment.in_features, dtype=dtype, device=flat.device)
    if flat.numel():
        _gather_kernel[(flat.numel(), -(-segment.in_features // chunk))](
            flat, segment.data, _table(flat.device), out, segment.in_features, segment.data.stride(0),
            TYPE=kind.ggml, BLOCK=kind.block, BYTES=kind.bytes, CHUNK=chunk)
    return out.reshape(*ids.shape, -1)
