"""--cpu-kernels (auto, native, torch), the native build's cache, and its fallbacks (no compiler, a failing build)."""
from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from pdserve import kernels
from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.worker.startup import cpu_kernels
from pdserve.engine.worker.startup.cpu_kernels import prepare_cpu_kernels, probe_layer_ops
from pdserve.engine.worker.startup.defaults import ProbeResult
from pdserve.kernels import native, native_linear
from pdserve.kernels.rms_norm import rms_norm_ref
from tests.models import demo_checkpoint, engine_config, hf_checkpoint

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
needs_native = pytest.mark.skipif(native.cpu_kernels() is None, reason="no C++ compiler")


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """The native state as a new process sees it, with an empty cache; restored afterwards."""
    native.cpu_kernels()                          # NOTE: so that monkeypatch restores the real one
    monkeypatch.delitem(native._cpu_state, "library")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    return tmp_path


def test_without_a_compiler_the_references_serve(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh_native / "no-such-c++"))
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native"):
        assert prepare_cpu_kernels("native").value == "torch"
    assert [r.message for r in caplog.records] == [
        f"native kernels cpu_kernels: no working compiler ({fresh_native / 'no-such-c++'}); using the torch path"]
    x, weight = torch.randn(3, 16), torch.rand(16)
    assert not kernels.use_native(x)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_a_failing_build_falls_back(fresh_native, monkeypatch, caplog):
    compiler = fresh_native / "broken-c++"       # answers --version, fails every compile
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo broken 1.0 && exit 0\necho "no such luck" >&2\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native"):
        assert native.cpu_kernels() is None
    assert len(caplog.records) == 1
    assert caplog.records[0].message.endswith("exited 1: no such luck); using the torch path")
    assert not list(fresh_native.glob("kernels/*.so*"))


@needs_native
def test_one_build_path_for_both_libraries_cached(fresh_native, monkeypatch):
    from pdserve.kernels.quant_linear import SOURCE

    assert native.cpu_kernels() is not None and native.load_native("quant_linear", (SOURCE,)) is not None
    names = sorted(p.name.rsplit("-", 1)[0] for p in (fresh_native / "kernels").iterdir())
    assert names == ["cpu_kernels", "quant_linear"]
    monkeypatch.delitem(native._cpu_state, "library")
    native._load.cache_clear()
    real_run = subprocess.run

    def no_compile(command, **kwargs):
        if "--version" not in command:
            pytest.fail(f"compiled again: {command}")
        return real_run(command, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", no_compile)
    assert native.cpu_kernels() is not None             # loaded from the cache, no compiler run
    assert native.load_native("quant_linear", (SOURCE,)) is not None


def test_cpu_kernels_option():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).cpu_kernels == "auto"
    assert engine_config_from_args(parser.parse_args(["--cpu-kernels", "torch"])).cpu_kernels == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-kernels", "fast"])
    with pytest.raises(ValueError, match="--cpu-kernels"):
        prepare_cpu_kernels("fast")


def demo_config() -> ModelConfig:
    return ModelConfig.from_dir(demo_checkpoint())


@needs_native
@pytest.mark.parametrize("native_s, expected", [(1.0, "native"), (3.0, "torch")])
def test_auto_takes_what_the_probe_finds_faster(monkeypatch, native_s, expected):
    monkeypatch.setattr(cpu_kernels, "probe_layer_ops",
                        lambda *a: ProbeResult.of({"native": native_s, "torch": 2.0}))
    decision = prepare_cpu_kernels("auto", demo_config(), torch.float32, 2)
    assert decision.value == expected and "auto:" in decision.reason
    assert kernels.use_native(torch.randn(2, 4)) == (expected == "native")


@needs_native
def test_the_probe_times_both_paths_on_the_models_shapes():
    result = probe_layer_ops(demo_config(), torch.float32, threads=min(2, os.cpu_count() or 1))
    assert [name for name, _ in result.seconds] == ["native", "torch"]
    assert all(0 < seconds < float("inf") for _, seconds in result.seconds)


def test_torch_is_taken_without_building(monkeypatch):
    monkeypatch.setattr(native, "cpu_kernels", lambda: pytest.fail("built for --cpu-kernels torch"))
    assert prepare_cpu_kernels("torch", demo_config()).value == "torch"
    assert not kernels.use_native(torch.randn(2, 4))


def generate(cpu_kernels: str, mode: str, prompts=tuple(list(range(3, 3 + n)) for n in (5, 40, 130))):
    llm = LLM(config=engine_config(demo_checkpoint(), cpu_kernels=cpu_kernels, mode=mode, max_prefill_tokens=64))
    try:
        return llm.generate(list(prompts), GREEDY)
    finally:
        llm.close()


@needs_native
@pytest.mark.parametrize("mode", ["adaptive", "colocated", "disaggregated"])
def test_native_and_torch_kernels_generate_the_same_tokens(monkeypatch, mode):
    calls = []
    real = kernels.decode_attention_native
    monkeypatch.setattr(kernels, "decode_attention_native", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ours = generate("native", mode)
    assert calls, "the native attention never ran"
    monkeypatch.setattr(kernels, "decode_attention_native",
                        lambda *a, **kw: pytest.fail("native with --cpu-kernels torch"))
    reference = generate("torch", mode)
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), atol=1e-4, rtol=0)


def test_worker_processes_apply_the_coordinators_decision():
    """A spawned worker starts with the module defaults: it must get --cpu-kernels' decision, not probe again."""
    llm = LLM(config=engine_config(demo_checkpoint(), cpu_kernels="torch", mode="colocated", workers="process",
                                   max_prefill_tokens=64))
    try:
        assert [unit.spec.cpu_kernels for unit in llm.engine.units.all()] == ["torch"]
        ours = llm.generate([list(range(3, 40))], GREEDY)
    finally:
        llm.close()
    [expected] = generate("native", "colocated", [list(range(3, 40))])
    assert ours[0].token_ids == expected.token_ids



@needs_native
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_the_native_linear_is_chosen_at_load_for_every_thread_count(monkeypatch, workers):
    """Serving steps never time the native linear against BLAS: every batch bucket was decided at load, for
    each actor's own cores and for all of them (a lent step); a step that had to decide fails here."""
    monkeypatch.setattr(native_linear, "_winners", {})
    llm = LLM(config=engine_config(demo_checkpoint(), cpu_kernels="native", mode="adaptive", workers=workers,
                                   prefill_threads=1, decode_threads=1, max_prefill_tokens=64))
    try:
        if workers == "thread":
            assert {key[-1] for key in native_linear._winners} == {1, min(len(os.sched_getaffinity(0)), 2)}
            assert {key[-2] for key in native_linear._winners} == set(native_linear.row_buckets())
            monkeypatch.setattr(native_linear, "_measure", lambda *a: pytest.fail("a step timed the linear"))
        outputs = llm.generate([list(range(3, 3 + n)) for n in (5, 40, 130)] * 3, GREEDY)
    finally:
        llm.close()
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)


def test_the_native_linear_race_streams_the_weights_and_decides_every_shape_of_a_dtype(monkeypatch):
    """One race per dtype, bucket and thread count over the weights in model order up to the bytes asked;
    each shape of that dtype takes its winner (a step runs them all)."""
    monkeypatch.setattr(native_linear, "_winners", {})
    weights = [torch.zeros(8, 16), torch.zeros(4, 16), torch.zeros(8, 16), torch.zeros(8, 16, dtype=torch.bfloat16)]
    raced = []

    def race(streamed, rows):
        raced.append((streamed[0].dtype, len(streamed), rows))
        return (1.0, 2.0) if rows <= 4 else (2.0, 1.0)                 # native wins up to 4 rows

    monkeypatch.setattr(native_linear, "race", race)
    decided = native_linear.warm_prefer_native(weights + [weights[0]], (1,), stream_bytes=2 * 8 * 16 * 4)
    assert decided == 3 * len(native_linear.row_buckets())             # (8, 16) f32, (4, 16) f32, (8, 16) bf16
    assert {(dtype, n) for dtype, n, _ in raced} == {(torch.float32, 3), (torch.bfloat16, 1)}   # to the bytes, once each
    for (dtype, out, inp, bucket, threads), wins in native_linear._winners.items():
        assert wins == (bucket <= 4) and threads == 1


@needs_native
def test_a_head_size_the_native_attention_does_not_take_starts_with_a_measured_choice(caplog):
    config = ModelConfig.from_dir(hf_checkpoint("llama-head24"))
    assert config.head_dim == 24
    result = probe_layer_ops(config, torch.float32, threads=1)
    assert all(0 < seconds < float("inf") for _, seconds in result.seconds)
    decision = prepare_cpu_kernels("auto", config, torch.float32, 1)
    assert decision.value in ("native", "torch") and "auto:" in decision.reason


@needs_native
def test_a_failing_probe_keeps_the_references(monkeypatch):
    def broken(*args):
        raise ZeroDivisionError("a probe that cannot measure")

    monkeypatch.setattr(cpu_kernels, "probe_layer_ops", broken)
    decision = prepare_cpu_kernels("auto", demo_config(), torch.float32, 1)
    assert decision.value == "torch" and "probe failed (ZeroDivisionError)" in decision.reason
    assert not kernels.use_native(torch.randn(2, 4))
