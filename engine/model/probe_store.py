"""The GGUF block probe's answer kept on disk. Up to how many rows the block kernels beat dequantized tiles
depends on the machine, the file, the activations' dtype and the threads, none of which change between starts
of one service; timed at every start, a near tie at the crossover gave one quiet machine different answers
from one start to the next, and with them each step's kernel path, its cost and its rounding. The first
start's answer is kept under the cache folder and every later start with the same inputs takes it; removing
`$PDSERVE_CACHE/probes/` measures again."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pdserve.engine.model.cache import KeptAnswer, cache_root, pdserve_version
from pdserve.kernels.native import cpu_flags

FORMAT = 1


def probe_key(path: Path, dtype: torch.dtype, threads: int, probed: str, probe_bytes: int) -> dict:
    """Everything the block probe's answer depends on: pdserve, the CPU, the GGUF file, dtype, threads and what
    the probe streams."""
    stat = path.stat()
    return {"pdserve": pdserve_version(), "cpu": [cpu_flags(), os.cpu_count(), probe_bytes],
            "file": [str(path.resolve()), stat.st_size, stat.st_mtime_ns], "dtype": str(dtype), "threads": threads,
            "probed": probed}


class ProbeStore:
    """One probe answer's file: `load()` the kept (max_rows, report) or None, `save(max_rows, report)`."""

    def __init__(self, key: dict, root: Path | None = None) -> None:
        self.kept = KeptAnswer("probes", key, FORMAT, root or cache_root())
        self.path = self.kept.path

    def load(self) -> tuple[int, str] | None:
        data = self.kept.load()
        return None if data is None else (int(data["max_rows"]), str(data["report"]))

    def save(self, max_rows: int, report: str) -> None:
        self.kept.save({"max_rows": max_rows, "report": report})
