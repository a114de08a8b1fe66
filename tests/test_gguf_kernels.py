"""The native GGUF kernels (kernels/gguf_linear.py) against gguf.quants.dequantize and a float64 matmul.

The kernel quantizes the activations per block as llama.cpp does, so it is held to two bounds:
- against the float64 product with the *unquantized* x: the activation error, sum_k |w_k| d_b / 2 (each
  x_k rounds to the nearest multiple of its block's scale d_b = amax_b / 127), plus the float32 term below;
- against the float64 product with the activations as ggml's reference quantizers round them
  (`quantize_q8`, `quantize_q8_k`, transcribed from ggml-quants.c; the kernel's own quantizer is checked
  against gguf.quants and them): the float32 term alone, (blocks + 8) * 2^-23 * sum_k A_k |x_k|, A_k the
  magnitude of the terms the kernel sums for weight k (|w| + 2 |offset part| where it applies an offset
  through the activation sums), plus one bfloat16 rounding of the output (2^-8 |y|).
A wrong nibble, sub-block scale or offset misses the second bound by orders of magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import native
from pdserve.kernels.gguf_formats import TYPES, GGUFMatrix, Segment, dequantize_reference
from pdserve.kernels.gguf_linear import gguf_gather, gguf_linear_native, gguf_linear_tiled, native_available
from tests.gguf_models import random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler for the native kernels")
Q = gguf.GGMLQuantizationType
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
SIGNED = ("Q8_0", "IQ4_NL", "IQ4_XS")            # the kernel multiplies |w| by sign-adjusted activations
QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q4_K": (16, 144),
               "Q5_K": (16, 176), "Q6_K": (0, 192)}   # the bytes holding a block's quants (offset types)
BATCHES = (1, 2, 3, 5, 8, 17, 64)


def matrix_of(kind: str, rows: int, cols: int, seed: int) -> GGUFMatrix:
    return GGUFMatrix((Segment(kind, torch.from_numpy(random_blocks(Q[kind], rows, cols, seed))),), cols)


def width(kind: str, seed: int) -> int:
    """An odd number of blocks: 3 or 5 super-blocks, 3 to 9 32-weight blocks."""
    return TYPES[kind].block * (3 + 2 * (seed % 2 if TYPES[kind].block == 256 else seed % 4))


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0 (as gguf.quants rounds it, to nearest even): float64 x_hat."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))
    return (np.rint(blocks * inverse).astype(np.float64) * d).reshape(x.shape)


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref: float64 x_hat."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 256)
    at = np.abs(blocks).argmax(axis=-1)[..., None]
    largest = np.take_along_axis(blocks, at, axis=-1)
    inverse = np.where(largest == 0, np.float32(0), np.float32(-127) / np.where(largest == 0, 1, largest))
    q = np.minimum(np.rint(inverse * blocks), 127)
    d = np.where(largest == 0, np.float32(0), np.float32(1) / np.where(inverse == 0, 1, inverse))
    return (q.astype(np.float64) * d).reshape(x.shape)


def act_step(x: np.ndarray, block: int) -> np.ndarray:
    """Per element, its block's scale amax / 127 (an activation rounds by at most half of it)."""
    amax = np.abs(x.astype(np.float64)).reshape(*x.shape[:-1], -1, block).max(axis=-1, keepdims=True)
    return np.broadcast_to(amax / 127, (*amax.shape[:-1], block)).reshape(x.shape)


def term_magnitudes(matrix: GGUFMatrix) -> np.ndarray:
    """A_k: |w| for signed types, |w| + 2 |offset part| (the dequantized block with its quants zeroed)."""
    parts = []
    for s in matrix.segments:
        w = np.abs(dequantize_reference(GGUFMatrix((s,), matrix.in_features)).double().numpy())
        if s.type in QUANT_BYTES:
            first, stop = QUANT_BYTES[s.type]
            size = TYPES[s.type].bytes
            zeroed = s.data.numpy().copy().reshape(s.rows, -1, size)
            zeroed[:, :, first:stop] = 0
            offsets = dequantize_reference(GGUFMatrix((Segment(s.type, torch.from_numpy(zeroed.reshape(s.rows, -1))),),
                                                      matrix.in_features)).double().numpy()
            w = w + 2 * np.abs(offsets)
        parts.append(w)
    return np.concatenate(parts)


def float32_bound(matrix: GGUFMatrix, x_hat: np.ndarray) -> np.ndarray:
    blocks = max(matrix.in_features // TYPES[s.type].block for s in matrix.segments)
    return (blocks + 8) * 2.0 ** -23 * (np.abs(x_hat) @ term_magnitudes(matrix).T)


def x_hat_of(matrix: GGUFMatrix, x: np.ndarray) -> np.ndarray:
    """Per segment, the activations the kernel multiplies: q8_K, q8, or x itself (F32 / F16 / BF16 rows)."""
    return [quantize_q8_k(x) if TYPES[s.type].block == 256 else quantize_q8(x) if TYPES[s.type].block == 32
            else x for s in matrix.segments]


def check(y: torch.Tensor, matrix: GGUFMatrix, x: torch.Tensor) -> None:
    w = dequantize_reference(matrix).double().numpy()
    xs = x.double().numpy()
    rounding = 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0
    ours, column = y.double().numpy(), 0
    for s, x_hat in zip(matrix.segments, x_hat_of(matrix, xs)):
        part, got = w[column:column + s.rows], ours[:, column:column + s.rows]
        exact, quantized = xs @ part.T, x_hat @ part.T
        eps = float32_bound(GGUFMatrix((s,), matrix.in_features), x_hat) + rounding * np.abs(quantized)
        step = act_step(xs, TYPES[s.type].block) if TYPES[s.type].block > 1 else np.zeros_like(xs)
        assert np.all(np.abs(got - quantized) <= eps), f"{s.type}: {np.abs(got - quantized).max():.3g} > float32 bound"
        activation = (np.abs(part) @ (step.T * (0.5 + 2.0 ** -20))).T
        assert np.all(np.abs(got - exact) <= activation + eps + rounding * np.abs(exact)), s.type
        column += s.rows


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_type_against_gguf_dequantize_and_a_float64_matmul(kind, dtype):
    for seed, batch in enumerate(BATCHES):
        matrix = matrix_of(kind, rows=7 + 10 * seed, cols=width(kind, seed), seed=seed)
        x = torch.randn(batch, matrix.in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)
        check(gguf_linear_native(x, matrix, threads=1 + seed % 2), matrix, x)


def test_the_bounds_catch_a_wrong_sub_block_scale():
    """A kernel that got one Q4_K sub-block's scale wrong (emulated on the weights) breaks the bound."""
    matrix = matrix_of("Q4_K", rows=16, cols=512, seed=3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    y = gguf_linear_native(x, matrix)
    broken = matrix.segments[0].data.clone()
    broken[:, 4] ^= 1                                         # sub-block 0's 6-bit scale, lowest bit
    wrong = gguf_linear_native(x, GGUFMatrix((Segment("Q4_K", broken),), 512))
    check(y, matrix, x)
    with pytest.raises(AssertionError):
        check(wrong, matrix, x)


def test_a_fused_projection_keeps_each_part_in_its_type():
    kinds = ("Q4_K", "Q5_0", "Q8_0", "Q6_K", "F16")
    segments = []
    for i, kind in enumerate(kinds):
        if kind == "F16":
            values = np.random.default_rng(i).standard_normal((9, 512)).astype(np.float16) * 0.05
            segments.append(Segment(kind, torch.from_numpy(values.view(np.uint8).copy())))
        else:
            segments.append(Segment(kind, torch.from_numpy(random_blocks(Q[kind], 5 + i, 512, seed=i))))
    matrix = GGUFMatrix(tuple(segments), 512)
    for batch in (1, 6):
        x = torch.randn(batch, 512, generator=torch.Generator().manual_seed(batch))
        y = gguf_linear_native(x, matrix, threads=2)
        check(y, matrix, x)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_gathered_rows_are_gguf_dequantized_rows(kind):
    matrix = matrix_of(kind, rows=23, cols=width(kind, 1), seed=5)
    expected = dequantize_reference(matrix)
    ids = torch.tensor([22, 0, 5, 5, 17])
    assert torch.equal(gguf_gather(matrix.segments[0], ids, torch.float32), expected[ids])
    assert torch.equal(gguf_gather(matrix.segments[0], ids, torch.bfloat16), expected[ids].bfloat16())
    with pytest.raises(IndexError):
        gguf_gather(matrix.segments[0], torch.tensor([23]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 1])
def test_tiled_matmul_is_the_dequantized_matmul(dtype, parts, monkeypatch):
    from pdserve.kernels import gguf_linear

    if parts == 2:
        monkeypatch.setattr(gguf_linear, "TILE_BYTES", 7 * 512 * 4)   # several tiles a segment
    segments = (matrix_of("Q5_K", 20, 512, 1).segments[0], matrix_of("Q4_1", 9, 512, 2).segments[0])
    matrix = GGUFMatrix(segments[:parts], 512)                          # one part in one tile: y in place
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    w = dequantize_reference(matrix).double()
    expected = x.double() @ w.T
    weight_rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0       # the tile holds x's dtype
    bound = ((512 + 8) * 2.0 ** -23 + weight_rounding) * (x.double().abs() @ w.abs().T)
    bound += 2.0 ** -8 * expected.abs() if dtype == torch.bfloat16 else 0.0
    assert ((gguf_linear_tiled(x, matrix).double() - expected).abs() <= bound).all()


def test_the_activation_quantizers_round_as_gguf_and_ggml_do():
    """The kernel's q8 quantizer gives gguf.quants' Q8_0 integers (its d is kept in float32, not f16)."""
    import ctypes

    x = np.random.default_rng(0).standard_normal((1, 320)).astype(np.float32) * 3
    q, d, dsum = np.zeros(320, np.int8), np.zeros(10, np.float32), np.zeros(10, np.float32)
    library = native.cpu_kernels()
    library.pd_gguf_quantize_q8(ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(320),
                                *(ctypes.c_void_p(a.ctypes.data) for a in (q, d, dsum)))
    raw = gguf.quants.quantize(x, Q.Q8_0).reshape(10, 34)
    assert np.array_equal(q, raw[:, 2:].view(np.int8).reshape(-1))
    assert np.array_equal(d.astype(np.float16), raw[:, :2].copy().view(np.float16).reshape(-1))
    np.testing.assert_allclose(quantize_q8(x).reshape(-1), (q.reshape(10, 32) * d[:, None].astype(np.float64)).reshape(-1),
                               rtol=0)
    k = np.zeros(256, np.int8)
    dk, bsum = np.zeros(1, np.float32), np.zeros(16, np.int16)
    library.pd_gguf_quantize_q8_k(ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(256), ctypes.c_void_p(k.ctypes.data),
                                  ctypes.c_void_p(dk.ctypes.data), ctypes.c_void_p(bsum.ctypes.data))
    np.testing.assert_array_equal(quantize_q8_k(x[:, :256]).reshape(-1), k.astype(np.float64) * np.float64(dk[0]))
    assert np.array_equal(bsum, k.reshape(16, 16).sum(axis=1))


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="no kernel"):
        Segment("Q2_K", torch.zeros(2, 84, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not hold"):
        GGUFMatrix((Segment("Q4_K", torch.zeros(2, 144, dtype=torch.uint8)),), 512)
