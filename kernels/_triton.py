"""Optional Triton import.

Without Triton, `HAS_TRITON` is False, `jit` returns the function unchanged and
`tl` is a stand-in that only lets the kernel definitions import (their
`tl.constexpr` annotations are never evaluated); the reference path is then
always used. `INTERPRETED` records whether Triton was imported with
TRITON_INTERPRET=1: Triton fixes that choice when it is imported (its own
library functions are decorated then), so it holds for the whole process.
"""
from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    jit = triton.jit
except ImportError:  # NOTE: torch-only installs (e.g. CPU wheels without triton)
    triton = None
    tl = types.SimpleNamespace(constexpr=object)
    HAS_TRITON = False

    def jit(fn):
        return fn



def _imported_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


INTERPRETED = HAS_TRITON and _imported_interpreted()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
