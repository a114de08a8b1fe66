"""The compile key Triton's JIT would use for a CUDA launch, computed on CPU with Triton's own binder.

A JITFunction compiles once per distinct key: its arguments' specialization (dtype, and for integers
and pointers whether they equal 1 or are divisible by 16, unless `do_not_specialize` says otherwise),
the constexpr values and the launch options. `KeyRecorder` replaces the kernels of kernels/ and
records the key of every launch instead of running it (outputs stay uninitialised).
"""
from __future__ import annotations

import inspect
import sys

from tests.fake_cuda import KERNEL_MODULES


def _specializer(kernel, honour_do_not_specialize: bool):
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    fn = getattr(kernel, "fn", kernel)
    options = getattr(kernel, "kwargs", None) or {}
    skip = set(options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or ())
    skip = skip if honour_do_not_specialize else set()
    signature = inspect.signature(fn)
    params = [KernelParam(i, p, i in skip or p.name in skip, False)
              for i, p in enumerate(signature.parameters.values())]
    return fn.__name__, create_function_from_signature(signature, params, CUDABackend)


class KeyRecorder:
    """Records `(kernel name, specialization, options)` for every launch of the kernels of kernels/."""

    def __init__(self, monkeypatch, honour_do_not_specialize: bool = True) -> None:
        self.keys: list[tuple] = []
        for module in (sys.modules[name] for name in KERNEL_MODULES):
            for attr, kernel in list(vars(module).items()):
                if attr.startswith("_") and attr.endswith("_kernel"):
                    monkeypatch.setattr(module, attr, _Launcher(self, *_specializer(kernel, honour_do_not_specialize)))

    def distinct(self) -> set[tuple]:
        return set(self.keys)


class _Launcher:
    def __init__(self, recorder: KeyRecorder, name: str, binder) -> None:
        self.recorder, self.name, self.binder = recorder, name, binder

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.recorder.keys.append((self.name, tuple(map(tuple, specialization)),
                                       tuple(sorted(options.items()))))
        return launch
