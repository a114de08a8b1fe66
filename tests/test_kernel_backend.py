"""No silent slow path: the kernel path is checked at start-up; tiles that do not fit fall back."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.kernels import _triton, backend
from pdserve.kernels._triton import launch_fitting
from pdserve.kernels.backend import KernelBackendError, check_backend
from pdserve.kernels.prefill_attention import INTERPRETER_TILE, tile_configs
from tests.fake_cuda import fake_cuda
from tests.models import demo_checkpoint, engine_config

CUDA0 = torch.device("cuda:0")


@pytest.fixture
def without_triton(monkeypatch):
    for module in (kernels, backend):
        monkeypatch.setattr(module, "HAS_TRITON", False)
    monkeypatch.setattr(backend, "IMPORT_ERROR", "ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setattr(backend, "_warned", set())


def test_forced_triton_without_triton_fails_at_start_up_and_at_use(monkeypatch, without_triton):
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    with pytest.raises(KernelBackendError, match="PDSERVE_KERNELS=triton: Triton is not importable "
                                                 r"\(ModuleNotFoundError: No module named 'triton'\)"):
        check_backend(CUDA0)
    with pytest.raises(KernelBackendError, match="PDSERVE_KERNELS=triton"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)


def test_cuda_without_triton_warns_once_and_uses_the_references(monkeypatch, without_triton, caplog):
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.backend"):
        assert check_backend(CUDA0) == "torch"
        assert check_backend(CUDA0) == "torch"
    assert len(caplog.records) == 1
    assert "cuda:0: Triton is not importable" in caplog.text and "reference kernels" in caplog.text
    with fake_cuda(monkeypatch):
        assert not kernels.use_triton(torch.zeros(2, device="cuda:0"))


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    monkeypatch.setattr(backend, "INTERPRETED", False)
    with pytest.raises(KernelBackendError, match="Triton kernels on cpu need TRITON_INTERPRET=1"):
        check_backend(torch.device("cpu"))


@pytest.mark.parametrize("mode, device, expected", [("torch", "cuda:0", "torch"), ("", "cpu", "torch"),
                                                    ("triton", "cpu", "triton")])
def test_the_path_each_setting_gives(monkeypatch, mode, device, expected):
    monkeypatch.setenv("PDSERVE_KERNELS", mode)
    assert check_backend(torch.device(device)) == expected


def test_an_unknown_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "trition")
    with pytest.raises(KernelBackendError, match="PDSERVE_KERNELS must be torch or triton .*'trition'"):
        check_backend(torch.device("cpu"))


def test_generate_without_triton_and_forced_triton_says_so_in_one_line(tmp_path):
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('triton is not built for this platform')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}", "PDSERVE_KERNELS": "triton",
           "PDSERVE_CACHE": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "generate", "--model", "demo:tiny", "hi"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    assert "PDSERVE_KERNELS=triton: Triton is not importable (ImportError: triton is not built" in result.stderr
    assert "Traceback" not in result.stderr


class FakeOutOfResources(Exception):
    pass


def test_a_tile_that_does_not_fit_falls_back_to_the_next_and_is_remembered(monkeypatch, caplog):
    monkeypatch.setattr(_triton, "_out_of_resources", lambda: FakeOutOfResources)
    monkeypatch.setattr(_triton, "_FITTING", {})
    tried = []

    def launch(config):
        tried.append(config["BLOCK_M"])
        if config["BLOCK_M"] > 64:
            raise FakeOutOfResources("out of resource: shared memory, Required: 180000, Hardware limit: 101376")

    configs = tile_configs(128, 2, 86)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels._triton"):
        launch_fitting(launch, configs, "key")
        launch_fitting(launch, configs, "key")
    assert tried == [128, 64, 64] and caplog.text.count("falling back") == 1
    with pytest.raises(FakeOutOfResources):
        launch_fitting(lambda config: launch({"BLOCK_M": 128}), configs, "other")


@pytest.mark.parametrize("arch", [80, 86, 89, 90, 75, 120])
@pytest.mark.parametrize("head_dim, element_bytes", [(64, 2), (128, 2), (256, 2), (64, 4), (128, 4), (80, 2)])
def test_every_target_gets_a_tile_and_ever_smaller_fallbacks(arch, head_dim, element_bytes):
    configs = tile_configs(head_dim, element_bytes, arch)
    areas = [c["BLOCK_M"] * c["BLOCK_N"] for c in configs]
    assert areas == sorted(areas, reverse=True) and len(set(areas)) == len(areas)
    assert tile_configs(head_dim, element_bytes, None) == (INTERPRETER_TILE,)


@pytest.mark.parametrize("cpu_kernels", ["native", "torch"])
def test_a_runner_chooses_its_backend_once_at_load(monkeypatch, cpu_kernels):
    """The steps of a loaded engine never choose a backend again: every op takes the runner's choice."""
    llm = LLM(config=engine_config(demo_checkpoint(), cpu_kernels=cpu_kernels, mode="colocated"))
    for choice in ("choose_backend", "use_native", "use_triton"):
        monkeypatch.setattr(kernels, choice, lambda x: pytest.fail("a step chose a kernel backend"))
    try:
        outputs = llm.generate([list(range(3, 40)), [5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0))
    finally:
        llm.close()
    assert [len(o.token_ids) for o in outputs] == [8, 8]
