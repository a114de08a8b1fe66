"""Open a GGUF file with the `gguf` package; typed metadata access whose errors name the file and key."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from gguf import GGUFValueType

SCALARS = {value_type: np.dtype(numpy_type).newbyteorder("<")
           for value_type, numpy_type in gguf.GGUFReader.gguf_scalar_to_np.items()}
LENGTH = struct.Struct("<Q")


class MetadataField(NamedTuple):
    """A metadata value read in one pass: what `gguf.ReaderField` answers with `contents()` and `types`,
    without an array per string (a 49152-token vocabulary made the package's reader take seconds)."""

    name: str
    types: list[GGUFValueType]
    raw: Any                              # bytes, a numpy array, or a list of bytes

    def contents(self) -> Any:
        if self.types[-1] == GGUFValueType.STRING:
            return self.raw.decode() if self.types[0] == GGUFValueType.STRING else [b.decode() for b in self.raw]
        values = self.raw.tolist()
        return values if self.types[0] == GGUFValueType.ARRAY else values[0]

    @property
    def parts(self) -> list:
        return [self.raw]


class GGUFMetadataReader(gguf.GGUFReader):
    """gguf.GGUFReader whose metadata fields are MetadataFields (tensors as the package builds them);
    a big-endian file, or an array of arrays, is read the package's way."""

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        buffer = memoryview(self.data)
        for done in range(count):
            start = offs
            key, offs = _string(buffer, offs)
            value_type = GGUFValueType(int(np.frombuffer(buffer, "<u4", 1, offs)[0]))
            item_type = GGUFValueType(int(np.frombuffer(buffer, "<u4", 1, offs + 4)[0])) \
                if value_type == GGUFValueType.ARRAY else value_type
            if item_type == GGUFValueType.ARRAY:
                return super()._build_fields(start, count - done)
            field, offs = _field(buffer, offs + 4, key.decode(), value_type, item_type)
            self._push_field(field, skip_sum=True)
        return offs


def _string(buffer: memoryview, offs: int) -> tuple[bytes, int]:
    (length,) = LENGTH.unpack_from(buffer, offs)
    end = offs + 8 + length
    if end > len(buffer):
        raise ValueError(f"a string at byte {offs} runs past the end of the file")
    return bytes(buffer[offs + 8:end]), end


def _field(buffer: memoryview, offs: int, name: str, value_type: GGUFValueType, item_type: GGUFValueType):
    count = 1
    types = [value_type]
    if value_type == GGUFValueType.ARRAY:
        (count,) = LENGTH.unpack_from(buffer, offs + 4)
        offs += 12
        types.append(item_type)
    if item_type == GGUFValueType.STRING:
        raw = []
        for _ in range(count):
            value, offs = _string(buffer, offs)
            raw.append(value)
        return MetadataField(name, types, raw[0] if value_type == GGUFValueType.STRING else raw), offs
    dtype = SCALARS.get(item_type)
    if dtype is None:
        raise ValueError(f"metadata {name} has unknown type {item_type}")
    values = np.frombuffer(buffer, dtype, count, offs)
    return MetadataField(name, types, values), offs + dtype.itemsize * count


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unreadable, unsupported, or inconsistent. Names the file."""


class GGUFFile:
    """The metadata and tensors of one GGUF file (memory-mapped: tensor data is read on access)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._reader = GGUFMetadataReader(path)
        except Exception as e:  # NOTE: the reader raises ValueError, IndexError, ... on a bad file
            raise GGUFError(f"{path}: not a readable GGUF file, truncated or corrupt "
                            f"({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = self.string("general.architecture")

    def __contains__(self, key: str) -> bool:
        return key in self._reader.fields

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key` as Python (str, int, float, bool, list), or `default`."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise self.error(f"metadata {key} cannot be read ({e})") from None

    def string(self, key: str, default: str | None = None) -> str:
        return self._typed(key, str, default)

    def integer(self, key: str, default: int | None = None) -> int:
        return self._typed(key, int, default)

    def number(self, key: str, default: float | None = None) -> float:
        return float(self._typed(key, (int, float), default))

    def strings(self, key: str) -> list[str]:
        values = self.value(key)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise self.error(f"metadata {key} must be a list of strings")
        return values

    def arch(self, suffix: str) -> str:
        """The metadata key of `suffix` under this file's architecture: 'llama.block_count'."""
        return f"{self.architecture}.{suffix}"

    def error(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    def _typed(self, key: str, kind, default):
        value = self.value(key, default)
        if value is None:
            raise self.error(f"metadata key {key} is missing")
        if isinstance(value, bool) or not isinstance(value, kind):
            raise self.error(f"metadata {key} = {value!r} is not a {getattr(kind, '__name__', 'number')}")
        return value
