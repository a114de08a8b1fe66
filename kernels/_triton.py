"""Optional Triton import, and what the kernels need to know about the GPU they compile for.

Triton is imported where it can run (`_wanted`). Without it, `HAS_TRITON` is False, `jit` returns the function unchanged and
`tl` is a stand-in that only lets the kernel definitions import (their
`tl.constexpr` annotations are never evaluated); the reference path is then
always used. `INTERPRETED` records whether Triton was imported with
TRITON_INTERPRET=1: Triton fixes that choice when it is imported (its own
library functions are decorated then), so it holds for the whole process.
"""
from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Callable, Hashable, Sequence

import torch

from pdserve import env


def _wanted() -> bool:
    """Triton is imported only where its kernels can run: with a CUDA device, under its interpreter, or when
    PDSERVE_KERNELS=triton forces it (its import alone holds ~80 MB a CPU-only server has no use for)."""
    return (os.environ.get("TRITON_INTERPRET") == "1" or env.kernels_override() == "triton"
            or torch.cuda.is_available())


try:
    if not _wanted():
        raise ImportError("not imported: no CUDA device, no TRITON_INTERPRET=1, PDSERVE_KERNELS is not triton")
    import triton
    import triton.language as tl

    HAS_TRITON = True
    IMPORT_ERROR = ""
except ImportError as exc:  # NOTE: torch-only installs (e.g. aarch64, where triton is not declared)
    triton = None
    tl = types.SimpleNamespace(constexpr=object)
    HAS_TRITON = False
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

logger = logging.getLogger(__name__)


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """`triton.jit`, also as `@jit(do_not_specialize=(...))`; the function itself without Triton.

    NOTE: Triton compiles one variant per value class of every integer argument (equal to 1,
    divisible by 16, other); runtime sizes named in `do_not_specialize` share one compiled kernel.
    """
    def decorate(kernel):
        if not HAS_TRITON:
            return kernel
        return triton.jit(kernel, do_not_specialize=list(do_not_specialize) or None)

    return decorate(fn) if fn is not None else decorate


def _imported_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


INTERPRETED = HAS_TRITON and _imported_interpreted()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def target_arch(device: torch.device) -> int | None:
    """The compute capability Triton compiles for (90 for sm_90), or None under the interpreter."""
    if INTERPRETED or device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


# NOTE: opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), the limit a
# compiled kernel must fit; CUDA programming guide, "Compute capabilities", technical specifications.
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def shared_memory_limit(arch: int) -> int:
    """Bytes of shared memory one block may use on `arch`; unknown targets get the smallest (99 KB)."""
    return SHARED_MEMORY_LIMITS.get(arch, min(SHARED_MEMORY_LIMITS.values()))


_FITTING: dict[Hashable, int] = {}


def launch_fitting(launch: Callable[[dict], None], configs: Sequence[dict], key: Hashable) -> None:
    """`launch(config)` with the first of `configs` whose compiled kernel fits the device's resources.

    The choice is remembered per `key`; a config that does not fit (Triton raises OutOfResources when
    it loads the kernel, before anything runs) is logged once and the next one is tried."""
    start = _FITTING.get(key, 0)
    for index in range(start, len(configs)):
        try:
            launch(configs[index])
        except _out_of_resources() as exc:
            if index + 1 == len(configs):
                raise
            logger.warning("%s: %s; falling back to %s", key, exc, configs[index + 1])
            continue
        _FITTING[key] = index
        return


def _out_of_resources() -> type[BaseException]:
    from triton.runtime.errors import OutOfResources

    return OutOfResources
