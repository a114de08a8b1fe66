"""KV pool sizing from a memory budget."""
from __future__ import annotations

import re

import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.kernels.kv_layout import KVLayout

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_memory(spec: str | float | int) -> tuple[int | None, float | None]:
    """'2GiB' -> (bytes, None); '0.4' -> (None, fraction). Raises ValueError on anything else."""
    text = str(spec).strip().lower()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"kv-cache-memory {spec!r}: expected bytes (e.g. 4GiB) or a fraction in (0, 1]")
    value, unit = float(match.group(1)), match.group(2)
    if unit == "" and value <= 1.0:
        if value <= 0:
            raise ValueError(f"kv-cache-memory {spec!r}: a fraction must be in (0, 1]")
        return None, value
    return int(value * _UNITS[unit]), None


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


DEFAULT_KV_BUDGET = {"cpu": "2GiB", "cuda": "0.8"}


def kv_layout(config: ModelConfig, block_size: int, split: bool = False) -> KVLayout:
    """A pool block's layout: every attention layer, or with `split` (a `split_window` model's sliding layers kept
    apart, in window slots) the full layers only."""
    if split:
        return KVLayout(config.num_full_layers, block_size, *config.kv_shape(sliding=False))
    if config.mixed_kv_shapes:
        raise ValueError(f"{config.name}'s layers keep K and V of different shapes: its sliding layers' live in "
                         f"window slots, which KV tiers (--kv-offload-memory, --kv-offload-disk) cannot hold")
    return KVLayout(config.num_kv_layers, block_size, config.num_kv_heads, config.head_dim)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, split: bool = False) -> int:
    return kv_layout(config, block_size, split).block_bytes(dtype)


def num_kv_blocks(spec: str | None, share: float, device: torch.device, config: ModelConfig,
                  block_size: int, dtype: torch.dtype, max_useful_blocks: int, split: bool = False) -> int:
    """Blocks that fit `share` of the budget `spec` (never more), capped at what can ever be used.

    `spec` None means the device type's default (DEFAULT_KV_BUDGET)."""
    absolute, fraction = parse_memory(spec or DEFAULT_KV_BUDGET[device.type])
    budget = absolute if absolute is not None else int(fraction * free_device_memory(device))
    blocks = int(budget * share) // kv_block_bytes(config, block_size, dtype, split)
    if blocks < 1:
        raise ValueError(f"kv-cache-memory {spec!r} leaves no room for a single KV block "
                         f"({kv_block_bytes(config, block_size, dtype, split)} bytes) on {device}")
    return min(blocks, max_useful_blocks)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20          # glibc's ceiling on 64-bit


def keep_freed_memory_in_process() -> bool:
    """Stop glibc from returning every freed multi-MB tensor to the OS (CPU inference only).

    A decode step allocates and frees dozens of megabyte-sized tensors. With glibc's
    defaults each one is a fresh mmap whose pages fault in again on every step, which
    cost a large share of a CPU decode step (bench/RESULTS.md, "Measured once"). Returns False where not glibc.
    """
    libc = _glibc()
    try:
        return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
                    and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except AttributeError:
        return False


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS, once (glibc's `malloc_trim`): the start-up profile's largest
    steps (a full decode batch's logits among them) leave tens of MB free, which `keep_freed_memory_in_process`
    would hold for the process's life. Serving steps take what they need again. False where not glibc."""
    libc = _glibc()
    try:
        return bool(libc and libc.malloc_trim(0))
    except AttributeError:
        return False


def _glibc():
    """The C library, or None where it cannot be loaded."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
