"""Open a GGUF file with the `gguf` package; typed metadata access whose errors name the file and key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unreadable, unsupported, or inconsistent. Names the file."""


class GGUFFile:
    """The metadata and tensors of one GGUF file (memory-mapped: tensor data is read on access)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
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
