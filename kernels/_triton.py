"""Optional Triton import and a decoration-deferring `jit`.

Triton decides at decoration time whether a kernel is interpreted
(TRITON_INTERPRET=1), so kernels are wrapped by `triton.jit` at launch, once per
mode: importing `kernels` early never freezes that choice, and interpreted CPU
tests and compiled CUDA runs can share one process. Without Triton, `HAS_TRITON` is
False, `tl` is a stand-in that only lets kernel definitions import, and the
reference path is always used.
"""
from __future__ import annotations

import os
import types

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # NOTE: torch-only installs (e.g. CPU wheels without triton)
    triton = None
    tl = types.SimpleNamespace(constexpr=object)
    HAS_TRITON = False


class LazyKernel:
    """Wraps a kernel function; `triton.jit` runs at the first `kernel[grid]` of each interpreter mode."""

    __slots__ = ("fn", "_by_mode")

    def __init__(self, fn):
        self.fn = fn
        self._by_mode = {}

    def __getitem__(self, grid):
        if not HAS_TRITON:
            raise RuntimeError("triton is not installed")
        mode = interpreting()
        if mode not in self._by_mode:
            self._by_mode[mode] = triton.jit(self.fn)
        return self._by_mode[mode][grid]


def interpreting() -> bool:
    """Whether Triton would run kernels in its interpreter now (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jit(fn) -> LazyKernel:
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
