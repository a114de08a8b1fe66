"""A GGUF's weight blocks kept in $PDSERVE_CACHE as one flat file that every start memory-maps.

gguf's reader parses every metadata field first (SmolLM2's 49152-token vocabulary: seconds, ten times
the rest of a load), and a Llama GGUF's q/k rows need un-permuting, so the blocks each module computes
from are written once, in the model's row order, into `<key>.blocks` (each tensor 64-byte aligned) with
an index `<key>.json`; the key is the file's real path, size and modification time and the model's
shape. A start maps the file (torch.from_file: pages come from the page cache as they are read, shared
by every process that maps it) and builds each module's GGUFMatrix from views of it: the weights are
never copied into process memory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.model.cache import cache_root
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.gguf_blocks import GGUFBlocks, TensorBlocks, read_gguf_blocks
from pdserve.kernels.gguf_formats import GGUFMatrix, Segment

logger = logging.getLogger(__name__)

VERSION = 3                            # NOTE: bump when the saved layout changes
ALIGN = 64


@dataclass(frozen=True, slots=True)
class CachedBlocks:
    matrices: dict[str, GGUFMatrix]        # module name -> its blocks (views of the mapped file)
    names: dict[str, list[str]]            # module name -> the GGUF tensors of its segments
    skipped: dict[str, str]                # module name -> why it stays dense
    types: dict[str, str]                  # every GGUF tensor's name -> its type


def cached_gguf_blocks(path: str | Path, config: ModelConfig, tied_head: bool) -> CachedBlocks:
    """read_gguf_blocks, through the cache: written on the first call for this file, mapped on every call."""
    stem = cache_root() / "gguf-blocks" / _key(Path(path), config, tied_head)
    index = stem.with_suffix(".json")
    if not index.is_file():
        _write(read_gguf_blocks(path, config, tied_head), stem)
    try:
        return _load(stem)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        logger.warning("gguf block cache %s unreadable (%s); reading %s again", stem, e, path)
        _write(read_gguf_blocks(path, config, tied_head), stem)
        return _load(stem)


def _key(path: Path, config: ModelConfig, tied_head: bool) -> str:
    stat = path.stat()
    parts = [VERSION, os.path.realpath(path), stat.st_size, stat.st_mtime_ns, tied_head, config.num_layers,
             config.num_heads, config.num_kv_heads, config.hidden_size]
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:24]


def _write(blocks: GGUFBlocks, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    with _replacing(stem.with_suffix(".blocks")) as out:
        entries = {module: [_append(out, part) for part in parts] for module, parts in blocks.modules.items()}
        size = out.tell()
    index = {"size": size, "modules": entries, "skipped": blocks.skipped, "types": blocks.types}
    with _replacing(stem.with_suffix(".json"), "w") as out:
        json.dump(index, out)


def _append(out, part: TensorBlocks) -> dict:
    out.write(b"\0" * (-out.tell() % ALIGN))
    offset = out.tell()
    out.write(np.ascontiguousarray(part.data).data)
    rows, row_bytes = part.data.shape
    return {"name": part.name, "type": part.type, "offset": offset, "rows": rows, "row_bytes": row_bytes}


class _replacing:
    """A file written under a temporary name, renamed over `target` when the block ends without error."""

    def __init__(self, target: Path, mode: str = "wb") -> None:
        self.target, self.mode = target, mode

    def __enter__(self):
        fd, self.tmp = tempfile.mkstemp(dir=self.target.parent, suffix=".tmp")
        self.file = os.fdopen(fd, self.mode)
        return self.file

    def __exit__(self, kind, value, traceback) -> None:
        self.file.close()
        if kind is None:
            os.replace(self.tmp, self.target)
        elif os.path.exists(self.tmp):
            os.unlink(self.tmp)


def _load(stem: Path) -> CachedBlocks:
    index = json.loads(stem.with_suffix(".json").read_text())
    path = stem.with_suffix(".blocks")
    if path.stat().st_size != index["size"]:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, its index {index['size']}")
    mapped = torch.from_file(str(path), shared=True, size=index["size"], dtype=torch.uint8)   # NOTE: never written
    matrices, names = {}, {}
    for module, parts in index["modules"].items():
        names[module] = [p["name"] for p in parts]
        segments = tuple(Segment(p["type"], mapped[p["offset"]:p["offset"] + p["rows"] * p["row_bytes"]]
                                 .view(p["rows"], p["row_bytes"])) for p in parts)
        matrices[module] = GGUFMatrix(segments, segments[0].in_features)
    return CachedBlocks(matrices, names, index["skipped"], index["types"])
