"""The GGUF block probe's answer kept on disk. Up to how many rows the block kernels beat dequantized tiles
depends on the machine, the file, the activations' dtype and the threads, none of which change between starts
of one service; timed at every start, a near tie at the crossover gave one quiet machine different answers
from one start to the next, and with them each step's kernel path, its cost and its rounding. The first
start's answer is kept under the cache folder and every later start with the same inputs takes it; removing
`$PDSERVE_CACHE/probes/` measures again."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path

import torch

from pdserve.engine.model.cache import cache_root
from pdserve.kernels.native import cpu_flags

logger = logging.getLogger(__name__)

FORMAT = 1


def probe_key(path: Path, dtype: torch.dtype, threads: int, probed: str, probe_bytes: int) -> dict:
    """Everything the block probe's answer depends on: pdserve, the CPU, the GGUF file, dtype, threads and what
    the probe streams."""
    stat = path.stat()
    return {"pdserve": _version(), "cpu": [cpu_flags(), os.cpu_count(), probe_bytes],
            "file": [str(path.resolve()), stat.st_size, stat.st_mtime_ns], "dtype": str(dtype), "threads": threads,
            "probed": probed}


class ProbeStore:
    """One probe answer's file: `load()` the kept (max_rows, report) or None, `save(max_rows, report)`."""

    def __init__(self, key: dict, root: Path | None = None) -> None:
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = (root or cache_root()) / "probes" / f"{digest}.json"

    def load(self) -> tuple[int, str] | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if data.get("format") != FORMAT or data.get("key") != self.key:
            return None
        return int(data["max_rows"]), str(data["report"])

    def save(self, max_rows: int, report: str) -> None:
        """Written atomically; a cache folder that cannot be written is logged, and the next start probes again."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": FORMAT, "key": self.key, "max_rows": max_rows, "report": report}))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("GGUF block probe not kept (%s): the next start probes again", e)


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"
