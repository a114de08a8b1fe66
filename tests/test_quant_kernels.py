"""Quantized formats and the native quantized linear, against gguf.quants and plain torch.

Tolerance of the kernel against F.linear on the dequantized fp32 weight: the dequantized weights
are bit-equal (checked below), so the only differences are the order of the fp32 sums, bounded by
(K + 4) * 2^-24 * sum|x_k w_k| per output (Q8_0 scales a block's dot product once more), plus, for
bf16 outputs, one rounding (2^-9 relative; 2^-8 here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import native
from pdserve.kernels.quant_formats import (
    QuantizedWeight,
    concat_rows,
    dequantize,
    from_gguf_blocks,
    quantize_int8,
)
from pdserve.kernels.quant_linear import kernel_layout, native_available, quant_linear_native, quant_linear_ref

gguf = pytest.importorskip("gguf")
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def gguf_weight(gguf_type: str, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, np.ndarray]:
    """A random weight quantized by gguf itself; returns ours and gguf's own dequantization."""
    generator = np.random.default_rng(seed)
    weight = (generator.standard_normal((rows, cols)) * 0.05 + generator.uniform(-0.02, 0.02, (rows, 1)))
    kind = gguf.GGMLQuantizationType[gguf_type]
    raw = gguf.quants.quantize(weight.astype(np.float32), kind)
    return from_gguf_blocks(torch.from_numpy(raw), gguf_type), gguf.quants.dequantize(raw, kind)


def random_weight(fmt: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    if fmt == "int8":
        generator = torch.Generator().manual_seed(seed)
        return quantize_int8(torch.randn(rows, cols, generator=generator) * 0.05)
    return gguf_weight(fmt.upper(), rows, cols, seed)[0]


def assert_matches_dequantized(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight) -> None:
    dense = dequantize(w)
    expected = F.linear(x.float(), dense)
    bound = (x.shape[1] + 4) * 2.0 ** -24 * F.linear(x.float().abs(), dense.abs()) + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * expected.abs()
    excess = (y.float() - expected).abs() - bound
    assert excess.max() <= 0, f"worst excess {excess.max().item():.3g}"


@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
def test_gguf_blocks_dequantize_as_gguf_does(gguf_type):
    ours, expected = gguf_weight(gguf_type, 40, 96, seed=1)
    assert ours.shape == (40, 96)
    assert torch.equal(dequantize(ours), torch.from_numpy(expected))


def test_rows_and_concat_keep_blocks_exact():
    a, dense_a = gguf_weight("Q4_1", 12, 64, seed=2)
    b, dense_b = gguf_weight("Q4_1", 6, 64, seed=3)
    index = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    fused = concat_rows([a.rows(index), b])
    expected = torch.cat([torch.from_numpy(dense_a)[index], torch.from_numpy(dense_b)])
    assert torch.equal(dequantize(fused), expected)
    with pytest.raises(ValueError, match="different formats"):
        concat_rows([a, gguf_weight("Q8_0", 4, 64, seed=4)[0]])


def test_int8_per_channel_rounds_to_nearest_step():
    weight = torch.randn(33, 64, generator=torch.Generator().manual_seed(5))
    weight[3] = 0.0                                             # NOTE: an all-zero row must not divide by 0
    q = quantize_int8(weight)
    step = q.scales[:, None]
    assert (dequantize(q) - weight).abs().le(step / 2 + 1e-7).all()
    assert q.qs.view(torch.int8).abs().max() == 127
    assert torch.equal(dequantize(q)[3], torch.zeros(64))


def test_unsupported_gguf_type_is_refused():
    with pytest.raises(ValueError, match="Q6_K"):
        from_gguf_blocks(torch.zeros(4, 210, dtype=torch.uint8), "Q6_K")


needs_native = pytest.mark.skipif(not native_available(), reason="no C compiler for the native kernel")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
def test_native_kernel_matches_dequantized_linear(fmt, dtype):
    w = random_weight(fmt, 70, 160, seed=6)                      # NOTE: 70 rows: a partial tile of 4
    generator = torch.Generator().manual_seed(7)
    for rows in (1, 3, 4, 9, 32):
        x = torch.randn(rows, 160, generator=generator).to(dtype)
        y = quant_linear_native(x, kernel_layout(w), threads=2)
        assert y.dtype == dtype and y.shape == (rows, 70)
        assert_matches_dequantized(y, x, w)
        torch.testing.assert_close(y, quant_linear_ref(x, w), atol=1e-4, rtol=2 ** -7)


@needs_native
def test_native_kernel_same_result_on_any_thread_count():
    w = random_weight("q4_1", 64, 96, seed=8)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(9))
    kw = kernel_layout(w)
    assert torch.equal(quant_linear_native(x, kw, threads=1), quant_linear_native(x, kw, threads=2))


def test_loader_without_compiler_returns_none(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    from pdserve.kernels.quant_linear import SOURCE

    assert native.load_native("quant_linear", (SOURCE,)) is None


@needs_native
def test_loader_builds_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    from pdserve.kernels.quant_linear import SOURCE

    assert native.load_native("quant_linear", (SOURCE,)) is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
