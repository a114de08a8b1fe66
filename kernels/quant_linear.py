"""Linear layer over a quantized weight, dequantized on the fly: y = x @ dequantize(w)^T.

`quant_linear_native` runs the C kernel in quant_linear.c (built for the running CPU by
kernels.native; fp32 or bf16 activations, fp32 arithmetic, OpenMP over the output features) on a
`KernelWeight`: the weight's rows interleaved by tiles of TILE_ROWS, block by block, so a tile's
bytes (and its scales) are read as one stream (much faster than row-major: bench/RESULTS.md,
"Measured once"). `quant_linear_ref` is the plain-torch reference: F.linear of the fp32
activations against the dequantized fp32 weight, rounded to the activations' dtype.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels.native import load_native
from pdserve.kernels.quant_formats import BLOCK, FORMATS, QuantizedWeight, dequantize

SOURCE = Path(__file__).with_name("quant_linear.c")
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
TILE_ROWS = 4                        # NOTE: ROWS in quant_linear.c
BLOCK_BYTES = {"int8": 32, "q8_0": 32, "q4_0": 16, "q4_1": 16}


@dataclass(frozen=True, slots=True)
class KernelWeight:
    """A QuantizedWeight in the kernel's layout (rows padded to whole tiles)."""

    format: str
    shape: tuple[int, int]           # (out_features, in_features), without the padding
    qs: torch.Tensor                 # uint8 [tiles, K/32, TILE_ROWS, block bytes]
    scales: torch.Tensor             # int8: float32 [tiles * TILE_ROWS]; blocks: [tiles, K/32, TILE_ROWS]
    mins: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)


def kernel_layout(w: QuantizedWeight) -> KernelWeight:
    """Interleave the rows of `w` by tiles (exact: the same bytes and scales, reordered)."""
    rows, features = w.shape
    qs = _tiled(w.qs.reshape(rows, features // BLOCK, BLOCK_BYTES[w.format]))
    if w.format == "int8":
        padded = torch.zeros(qs.shape[0] * TILE_ROWS, dtype=torch.float32)
        padded[:rows] = w.scales
        return KernelWeight(w.format, w.shape, qs, padded, None)
    mins = None if w.mins is None else _tiled(w.mins)
    return KernelWeight(w.format, w.shape, qs, _tiled(w.scales), mins)


def _tiled(t: torch.Tensor) -> torch.Tensor:
    # t: [N, blocks, ...] -> [tiles, blocks, TILE_ROWS, ...], zero rows past N
    tiles = -(-t.shape[0] // TILE_ROWS)
    padded = torch.zeros((tiles * TILE_ROWS, *t.shape[1:]), dtype=t.dtype)
    padded[:t.shape[0]] = t
    return padded.reshape(tiles, TILE_ROWS, *t.shape[1:]).transpose(1, 2).contiguous()


def quant_linear_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    # x: [M, K] -> [M, N]
    return F.linear(x.float(), dequantize(w)).to(x.dtype)


@functools.cache
def _native_fn():
    library = load_native("quant_linear", (SOURCE,))
    if library is None:
        return None
    fn = library.quant_linear
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [i, i, p, p, p, p, p, i, p, i, i, i, i]
    fn.restype = i
    return fn


def quant_linear_address() -> int | None:
    """The C entry point's address, for native code that calls it directly (None where it cannot build)."""
    fn = _native_fn()
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def native_available() -> bool:
    """True when the C kernel is built (or builds now) for this CPU."""
    return _native_fn() is not None


def supports(fmt: str, in_features: int, x_dtype: torch.dtype) -> bool:
    """Whether the native kernel takes this format, width (a multiple of 32) and activation dtype."""
    return fmt in FORMATS and x_dtype in ACTIVATION_DTYPES and in_features % BLOCK == 0


def quant_linear_native(x: torch.Tensor, w: KernelWeight, threads: int | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16, contiguous, on CPU; returns [M, N] in x's dtype. Needs native_available()."""
    rows, features = w.shape
    assert x.dim() == 2 and x.shape[1] == features and x.is_contiguous() and x.device.type == "cpu"
    assert supports(w.format, features, x.dtype), (w.format, x.dtype, w.shape)
    y = torch.empty(x.shape[0], rows, dtype=x.dtype)
    if x.shape[0] == 0:
        return y
    mins = w.mins.data_ptr() if w.mins is not None else None
    block_scales, channel_scales = (None, w.scales.data_ptr()) if w.format == "int8" else (w.scales.data_ptr(), None)
    status = _native_fn()(FORMATS.index(w.format), TILE_ROWS, w.qs.data_ptr(), block_scales, mins, channel_scales,
                          x.data_ptr(), int(x.dtype == torch.bfloat16), y.data_ptr(), x.shape[0], rows,
                          features, threads or torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"quant_linear: kernel refused {w.format} {tuple(w.shape)} x {tuple(x.shape)}")
    return y
