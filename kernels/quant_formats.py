"""Weight-only quantized formats: int8 per output channel, and GGUF's Q8_0, Q4_0 and Q4_1 blocks.

A `QuantizedWeight` is a linear weight [out_features, in_features] kept quantized, rows being output
features. GGUF blocks hold 32 consecutive weights of one row (`gguf.quants` is the reference):

    Q8_0: f16 d, int8 q[32]            w = d * q
    Q4_0: f16 d, 16 bytes of nibbles   w = d * (q - 8)
    Q4_1: f16 d, f16 m, 16 bytes       w = d * q + m

a 4-bit block keeping element j in the low nibble of byte j and element j + 16 in the high one.
The blocks are split into a byte array and their scales (widened to float32, exactly), so rows can
be selected and concatenated (fused q/k/v, gate/up) exactly: quantization never crosses a row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
FORMATS = ("int8", "q8_0", "q4_0", "q4_1")


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    format: str                      # int8 | q8_0 | q4_0 | q4_1
    qs: torch.Tensor                 # uint8 [N, K] (int8 values) or [N, K/2] (two 4-bit values a byte)
    scales: torch.Tensor             # int8: float32 [N]; blocks: d [N, K/32] (the file's f16, as float32)
    mins: torch.Tensor | None = None  # q4_1: m [N, K/32] (float32 likewise)

    @property
    def shape(self) -> tuple[int, int]:
        per_byte = 2 if self.format in ("q4_0", "q4_1") else 1
        return self.qs.shape[0], self.qs.shape[1] * per_byte

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or a selection), exactly."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantizedWeight(self.format, self.qs[index].contiguous(), self.scales[index].contiguous(), mins)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output features (a fused projection)."""
    formats = {p.format for p in parts}
    if len(formats) != 1:
        raise ValueError(f"cannot fuse weights of different formats: {sorted(formats)}")
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    return QuantizedWeight(parts[0].format, torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]),
                           mins)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel: q = round(w / s), s = max|w_row| / 127."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.view(torch.uint8).contiguous(), scales.contiguous())


def from_gguf_blocks(raw: torch.Tensor, gguf_type: str) -> QuantizedWeight:
    """Split raw GGUF blocks, uint8 [N, blocks * block_bytes] (a tensor's data), into a QuantizedWeight."""
    if gguf_type not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type {gguf_type} has no quantized kernel (supported: {', '.join(GGUF_BLOCK_BYTES)})")
    size = GGUF_BLOCK_BYTES[gguf_type]
    rows, width = raw.shape
    if raw.dtype != torch.uint8 or width % size:
        raise ValueError(f"{gguf_type} rows must be uint8 bytes in blocks of {size}, got {raw.dtype} x {width}")
    blocks = raw.reshape(rows, width // size, size)                  # blocks: [N, K/32, block bytes]
    scales = 2 if gguf_type == "Q4_1" else 1                          # f16 values heading each block
    halves = blocks[..., :2 * scales].contiguous().view(torch.float16).float()  # [N, K/32, scales]
    qs = blocks[..., 2 * scales:].reshape(rows, -1).contiguous()
    mins = halves[..., 1].contiguous() if gguf_type == "Q4_1" else None
    return QuantizedWeight(gguf_type.lower(), qs, halves[..., 0].contiguous(), mins)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] (the reference the kernels are exact against)."""
    rows, _ = w.shape
    if w.format == "int8":
        return w.qs.view(torch.int8).float() * w.scales[:, None]
    d = w.scales.float()[..., None]                                  # d: [N, blocks, 1]
    if w.format == "q8_0":
        return (w.qs.view(torch.int8).float().reshape(rows, -1, BLOCK) * d).reshape(rows, -1)
    packed = w.qs.reshape(rows, -1, BLOCK // 2)
    q = torch.cat([packed & 15, packed >> 4], dim=-1).float()       # q: [N, blocks, 32]
    offset = w.mins.float()[..., None] if w.format == "q4_1" else -8.0 * d
    return torch.addcmul(offset, q, d).reshape(rows, -1)
