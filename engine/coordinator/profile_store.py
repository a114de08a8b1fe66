"""The start-up profile kept on disk. Its inputs do not change between restarts of one service (the machine,
the model file, dtype, quantization, the units and their threads, pdserve's version), so the steps it timed are
stored in the cache folder under a key of those and replayed into fresh cost models at the next start.
`--startup-profile refresh` measures again; so does a start whose probe steps (two) show one drifted far from the
stored timing of the same step."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.model.cache import KeptAnswer, cache_root, pdserve_version
from pdserve.engine.units.spec import Layout
from pdserve.engine.worker.startup.defaults import detect_cpu
from pdserve.engine.worker.tiers.records import model_files

FORMAT = 3                   # the profile's steps changed: a profile kept before is measured again
DRIFT = 2.0                  # a probe step this many times slower or faster than stored: the machine changed


class ProfileStore:
    """One start-up profile's file: `load()` its recorded steps or None, `save(recorded)`."""

    def __init__(self, key: dict, root: Path | None = None) -> None:
        self.kept = KeptAnswer("profiles", key, FORMAT, root or cache_root())
        self.key, self.path = key, self.kept.path

    def load(self) -> list | None:
        data = self.kept.load()
        return None if data is None else data["profiles"]

    def save(self, recorded: list) -> None:
        self.kept.save({"profiles": recorded})

    def discard(self) -> None:
        self.kept.discard()


def profile_key(model_dir: Path | None, layout: Layout, quantization: str, cpu_kernels: str, sched) -> dict:
    """Everything the start-up profile's timings depend on."""
    return {"pdserve": pdserve_version(), "machine": _machine(layout), "model": model_files(model_dir),
            "dtype": str(layout.dtype), "quantization": quantization, "cpu_kernels": cpu_kernels,
            "units": [[s.role, str(s.device), len(s.cores), list(s.thread_counts), s.warmup_role]
                      for s in layout.units],
            "steps": [sched.max_num_seqs, sched.max_prefill_tokens, layout.max_model_len, layout.block_size]}


def drifted(stored: float, measured: float) -> bool:
    return not stored / DRIFT <= measured <= stored * DRIFT



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
