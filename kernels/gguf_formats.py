"""GGUF weight blocks kept as they are, for kernels that compute straight from them.

A `GGUFMatrix` is a linear weight [out_features, in_features] made of row segments, each one GGUF
tensor's rows in its own block type (a fused q/k/v or gate/up projection whose parts llama-quantize
typed differently keeps one segment per part). A segment's data is uint8 [rows, row bytes]: the
blocks of each row as the file lays them out (ggml's block structs, `gguf.quants` is the reference),
typically a view of a memory-mapped file. F32 / F16 / BF16 segments are allowed beside blocks (a part
the quantizer left unquantized) and computed in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class BlockType:
    ggml: int            # ggml's type number (gguf.GGMLQuantizationType)
    block: int           # weights per block
    bytes: int           # bytes per block


TYPES = {
    "F32": BlockType(0, 1, 4), "F16": BlockType(1, 1, 2), "BF16": BlockType(30, 1, 2),
    "Q4_0": BlockType(2, 32, 18), "Q4_1": BlockType(3, 32, 20), "Q5_0": BlockType(6, 32, 22),
    "Q5_1": BlockType(7, 32, 24), "Q8_0": BlockType(8, 32, 34), "IQ4_NL": BlockType(20, 32, 18),
    "Q4_K": BlockType(12, 256, 144), "Q5_K": BlockType(13, 256, 176), "Q6_K": BlockType(14, 256, 210),
    "IQ4_XS": BlockType(23, 256, 136),
}
DENSE_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = tuple(t for t in TYPES if t not in DENSE_TYPES)


def row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights in `type_name`'s blocks."""
    t = TYPES[type_name]
    if in_features % t.block:
        raise ValueError(f"{type_name} rows hold multiples of {t.block} weights, not {in_features}")
    return in_features // t.block * t.bytes


@dataclass(frozen=True, slots=True)
class Segment:
    type: str                     # a key of TYPES
    data: torch.Tensor            # uint8 [rows, row bytes]

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"GGUF type {self.type} has no kernel (supported: {', '.join(TYPES)})")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.stride(1) != 1:
            raise ValueError(f"{self.type} blocks must be uint8 rows, got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        t = TYPES[self.type]
        return self.data.shape[1] // t.bytes * t.block

    def words(self) -> list[int]:
        """type, rows, data address, row stride in bytes (gguf_linear.cpp's Segment)."""
        return [TYPES[self.type].ggml, self.rows, self.data.data_ptr(), self.data.stride(0)]


@dataclass(frozen=True, slots=True, eq=False)
class GGUFMatrix:
    """A weight [sum of the segments' rows, in_features] in GGUF blocks."""

    segments: tuple[Segment, ...]
    in_features: int
    table: torch.Tensor = field(init=False)   # int64 [segments * 4]: what the native kernel reads

    def __post_init__(self) -> None:
        for s in self.segments:
            if s.in_features != self.in_features or s.data.shape[1] != row_bytes(s.type, self.in_features):
                raise ValueError(f"a {s.type} segment of {s.data.shape[1]} bytes a row does not hold "
                                 f"{self.in_features} weights")
        words = [w for s in self.segments for w in s.words()]
        object.__setattr__(self, "table", torch.tensor(words, dtype=torch.int64))

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(s.type for s in self.segments)

    def to(self, device: torch.device | str) -> GGUFMatrix:
        """The same blocks on `device` (a copy unless they are there)."""
        return GGUFMatrix(tuple(Segment(s.type, s.data.to(device)) for s in self.segments), self.in_features)


def dequantize_reference(matrix: GGUFMatrix) -> torch.Tensor:
    """float32 [out_features, in_features] by gguf.quants (the reference the kernels are held to)."""
    import gguf
    import numpy as np

    parts = []
    for s in matrix.segments:
        raw = s.data.cpu().numpy()
        kind = gguf.GGMLQuantizationType[s.type]
        if s.type == "F32":
            values = raw.view(np.float32)
        elif s.type == "F16":
            values = raw.view(np.float16).astype(np.float32)
        elif s.type == "BF16":
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = gguf.quants.dequantize(raw, kind)
        parts.append(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(s.rows, -1))
    return torch.cat(parts)
