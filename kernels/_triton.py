"""Optional Triton import and a decoration-deferring `jit`.

Triton decides at decoration time whether a kernel is interpreted
(TRITON_INTERPRET=1), so kernels are compiled lazily, on first launch: importing
`kernels` early never freezes that choice. Without Triton, `HAS_TRITON` is
False, `tl` is a stand-in that only lets kernel definitions import, and the
reference path is always used.
"""
from __future__ import annotations

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
    """Wraps a kernel function; `triton.jit` runs on the first `kernel[grid]`."""

    __slots__ = ("fn", "_jitted")

    def __init__(self, fn):
        self.fn = fn
        self._jitted = None

    def __getitem__(self, grid):
        if self._jitted is None:
            if not HAS_TRITON:
                raise RuntimeError("triton is not installed")
            self._jitted = triton.jit(self.fn)
        return self._jitted[grid]


def jit(fn) -> LazyKernel:
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
