"""PyPI packages whose names pdserve's top-level folders share, kept reachable from the repository root.

pdserve installs its folders as `pdserve.kernels`, `pdserve.bench`, ...; run from the checkout (`python -m pytest`,
`python -m pdserve.bench.X`), the root is on sys.path and a bare `import kernels` finds the folder instead of PyPI's
`kernels`, which transformers >= 5.25 requires and imports. Binding the name to the installed package first keeps
both working: pdserve's own code only ever imports `pdserve.kernels`.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
SHADOWED = ("kernels",)          # the folders with a PyPI namesake something we import imports


def prefer_installed(names: tuple[str, ...] = SHADOWED) -> None:
    """Bind each of `names` to the installed package of that name where one exists outside the repository root."""
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != REPOSITORY_ROOT]
    for name in names:
        module = sys.modules.get(name)
        if module is not None and not _inside_repository(module):
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _inside_repository(module) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and REPOSITORY_ROOT in Path(origin).resolve().parents
