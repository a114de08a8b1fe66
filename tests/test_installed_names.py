"""Run from the checkout, PyPI's `kernels` (which transformers >= 5.25 imports) is not shadowed by pdserve's folder."""
from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest

from pdserve.bench.installed_names import REPOSITORY_ROOT


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not installed("kernels"), reason="PyPI's kernels is not installed")
def test_a_bare_kernels_import_finds_the_installed_package_and_transformers_imports():
    kernels = importlib.import_module("kernels")
    assert not kernels.__file__.startswith(str(REPOSITORY_ROOT)) and hasattr(kernels, "get_kernel")
    script = ("from pdserve.bench.installed_names import prefer_installed; prefer_installed(); "
              "import transformers.activations, kernels; print(kernels.__file__)")
    shown = subprocess.run([sys.executable, "-c", script], cwd=REPOSITORY_ROOT, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert str(REPOSITORY_ROOT / "kernels") not in shown.stdout


def test_pdserve_kernels_stay_pdserves_own():
    import pdserve.kernels

    assert pdserve.kernels.__file__.startswith(str(REPOSITORY_ROOT / "kernels"))
