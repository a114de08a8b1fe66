"""Start-up of the native CPU kernels (kernels/csrc, built by kernels/_native.py).

`--cpu-kernels native` (the default) builds them before the engine reports ready, or loads the
build cached under $PDSERVE_CACHE/native/; `--cpu-kernels torch` serves CPU tensors with the
plain-torch references. A failed build logs one line and falls back to the references.
"""
from __future__ import annotations

import logging
import time

from kernels import _native

logger = logging.getLogger(__name__)

CPU_KERNELS = ("native", "torch")


def prepare_cpu_kernels(choice: str) -> bool:
    """Apply --cpu-kernels for this process; True when the native kernels serve CPU tensors.

    Raises ValueError for an unknown choice."""
    if choice not in CPU_KERNELS:
        raise ValueError(f"--cpu-kernels must be one of {', '.join(CPU_KERNELS)}, got {choice!r}")
    _native.set_enabled(choice == "native")
    if choice == "torch":
        logger.info("CPU kernels: the torch references (--cpu-kernels torch)")
        return False
    started = time.perf_counter()
    if _native.library() is None:
        return False                              # NOTE: _native logged why
    logger.info("CPU kernels: native (ready in %.1f s)", time.perf_counter() - started)
    return True
