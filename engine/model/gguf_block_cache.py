"""A GGUF's quantized projections kept in $PDSERVE_CACHE, so a second start skips the GGUF parse.

gguf's reader parses every metadata field first, which for a large vocabulary takes several times the
dense load (bench/RESULTS.md, "Measured once"), so the projections are saved once as safetensors, keyed
by the file's real path, size and modification time, written under a temporary name and renamed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pdserve.engine.model.cache import cache_root
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.gguf_blocks import GGUFProjections, read_gguf_projections
from pdserve.kernels.quant_formats import QuantizedWeight

logger = logging.getLogger(__name__)

VERSION = 1                            # NOTE: bump when the saved layout changes


def cached_gguf_projections(path: str | Path, config: ModelConfig, tied_head: bool) -> GGUFProjections:
    """read_gguf_projections, from the cache when this file was read before."""
    target = cache_root() / "gguf-blocks" / f"{_key(Path(path), config, tied_head)}.safetensors"
    if target.is_file():
        try:
            return _load(target)
        except (OSError, SafetensorError, ValueError, KeyError) as e:
            logger.warning("gguf block cache %s unreadable (%s); reading %s again", target, e, path)
    read = read_gguf_projections(path, config, tied_head)
    _save(read, target)
    return read


def _key(path: Path, config: ModelConfig, tied_head: bool) -> str:
    stat = path.stat()
    parts = [VERSION, os.path.realpath(path), stat.st_size, stat.st_mtime_ns, tied_head, config.num_layers,
             config.num_heads, config.num_kv_heads]
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:24]


def _save(read: GGUFProjections, target: Path) -> None:
    tensors = {}
    for name, w in read.weights.items():
        tensors[f"{name}.qs"], tensors[f"{name}.scales"] = w.qs, w.scales
        if w.mins is not None:
            tensors[f"{name}.mins"] = w.mins
    metadata = {"formats": json.dumps({n: w.format for n, w in read.weights.items()}),
                "skipped": json.dumps(read.skipped)}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(target: Path) -> GGUFProjections:
    with safe_open(target, framework="pt") as f:
        metadata = f.metadata()
        formats, names = json.loads(metadata["formats"]), set(f.keys())
        weights = {name: QuantizedWeight(fmt, f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.scales"),
                                         f.get_tensor(f"{name}.mins") if f"{name}.mins" in names else None)
                   for name, fmt in formats.items()}
    return GGUFProjections(weights, json.loads(metadata["skipped"]))
