"""The start-up profile kept on disk. Its inputs do not change between restarts of one service (the machine,
the model file, dtype, quantization, the units and their threads, pdserve's version), so the steps it timed are
stored in the cache folder under a key of those and replayed into fresh cost models at the next start.
`--startup-profile refresh` measures again; so does a start whose probe steps (two) show one drifted far from the
stored timing of the same step."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path

import torch

from pdserve.engine.model.cache import cache_root
from pdserve.engine.units.spec import Layout
from pdserve.engine.worker.startup.defaults import detect_cpu
from pdserve.engine.worker.tiers.records import model_files

logger = logging.getLogger(__name__)

FORMAT = 3                   # the profile's steps changed: a profile kept before is measured again
DRIFT = 2.0                  # a probe step this many times slower or faster than stored: the machine changed


class ProfileStore:
    """One start-up profile's file: `load()` its recorded steps or None, `save(recorded)`."""

    def __init__(self, key: dict, root: Path | None = None) -> None:
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = (root or cache_root()) / "profiles" / f"{digest}.json"

    def load(self) -> list | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if data.get("format") != FORMAT or data.get("key") != self.key:
            return None
        return data["profiles"]

    def save(self, recorded: list) -> None:
        """Write atomically (a reader never sees half a file); a cache folder that cannot be written is logged."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": FORMAT, "key": self.key, "profiles": recorded}))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("start-up profile not kept (%s): the next start measures again", e)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def profile_key(model_dir: Path | None, layout: Layout, quantization: str, cpu_kernels: str, sched) -> dict:
    """Everything the start-up profile's timings depend on."""
    return {"pdserve": _version(), "machine": _machine(layout), "model": model_files(model_dir),
            "dtype": str(layout.dtype), "quantization": quantization, "cpu_kernels": cpu_kernels,
            "units": [[s.role, str(s.device), len(s.cores), list(s.thread_counts), s.warmup_role]
                      for s in layout.units],
            "steps": [sched.max_num_seqs, sched.max_prefill_tokens, layout.max_model_len, layout.block_size]}


def drifted(stored: float, measured: float) -> bool:
    return not stored / DRIFT <= measured <= stored * DRIFT


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _machine(layout: Layout) -> list:
    parts = []
    if any(d.type == "cpu" for d in layout.devices):
        cpu = detect_cpu()
        parts.append([cpu.model, sorted(cpu.flags), len(layout.cores)])
    for device in layout.devices:
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else str(device)
            parts.append([name, torch.version.cuda])
    return parts

