"""--cpu-kernels, the native build's cache, and its fallbacks (no compiler, a failing build)."""
from __future__ import annotations

import logging
import subprocess

import pytest
import torch

import kernels
from engine.args import add_engine_args, engine_config_from_args
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.worker.cpu_kernels import prepare_cpu_kernels
from kernels import _native
from kernels.rms_norm import rms_norm_ref
from tests.models import demo_checkpoint, engine_config

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """The native state as a new process sees it, with an empty cache; restored afterwards."""
    _native.library()                             # NOTE: so that monkeypatch restores the real one
    monkeypatch.delitem(_native._state, "library")
    monkeypatch.setitem(_native._state, "enabled", True)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    return tmp_path


def test_without_a_compiler_the_references_serve(fresh_native, monkeypatch, caplog):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(_native.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="kernels._native"):
        assert not prepare_cpu_kernels("native")
    assert [r.message for r in caplog.records] == [
        "native CPU kernels unavailable (no C++ compiler found); using the torch references"]
    x, weight = torch.randn(3, 16), torch.rand(16)
    assert not kernels.use_native(x)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_a_failing_build_falls_back(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")            # a "compiler" that exits 1
    with caplog.at_level(logging.WARNING, logger="kernels._native"):
        assert _native.library() is None
    assert len(caplog.records) == 1 and "false exited 1" in caplog.records[0].message
    assert not list(fresh_native.glob("native/*.so"))


def test_the_build_is_cached(fresh_native, monkeypatch):
    if _native.library() is None:
        pytest.skip("no C++ compiler")
    builds = list(fresh_native.glob("native/pdkernels-*.so"))
    assert len(builds) == 1
    monkeypatch.delitem(_native._state, "library")
    real_run = subprocess.run

    def no_compile(command, **kwargs):
        if "--version" not in command:
            pytest.fail(f"compiled again: {command}")
        return real_run(command, **kwargs)

    monkeypatch.setattr(_native.subprocess, "run", no_compile)
    assert _native.library() is not None             # loaded from the cache, no compiler run


def test_cpu_kernels_option(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).cpu_kernels == "native"
    assert engine_config_from_args(parser.parse_args(["--cpu-kernels", "torch"])).cpu_kernels == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-kernels", "fast"])
    with pytest.raises(ValueError, match="--cpu-kernels"):
        prepare_cpu_kernels("fast")


def generate(monkeypatch, cpu_kernels: str, mode: str):
    monkeypatch.setitem(_native._state, "enabled", True)     # NOTE: restored after the test
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 130)]
    llm = LLM(config=engine_config(demo_checkpoint(), cpu_kernels=cpu_kernels, mode=mode, max_prefill_tokens=64))
    try:
        return llm.generate(prompts, GREEDY)
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_native_and_torch_kernels_generate_the_same_tokens(monkeypatch, mode):
    if _native.library() is None:
        pytest.skip("no C++ compiler")
    native = generate(monkeypatch, "native", mode)
    monkeypatch.setattr(kernels, "decode_attention_native", lambda *a: pytest.fail("native with --cpu-kernels torch"))
    reference = generate(monkeypatch, "torch", mode)
    for ours, theirs in zip(native, reference):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in ours.logprobs]),
                                   torch.tensor([lp.logprob for lp in theirs.logprobs]), atol=1e-4, rtol=0)
