"""Defaults chosen from the machine: decisions under faked CPUs and GPUs, the probe, and the overrides."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Machine
from pdserve.engine.worker.startup import defaults
from pdserve.engine.worker.startup.defaults import CpuInfo, GpuInfo, ProbeResult, choose_cpu_dtype, choose_cuda_dtype, choose_devices

AVX2 = CpuInfo("AMD EPYC 7B13", "AVX2", frozenset({"avx", "avx2", "fma"}))
AVX512_BF16 = CpuInfo("AMD EPYC 9B14", "AVX512", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = CpuInfo("Intel(R) Xeon(R) Platinum 8480+", "AVX512",
              frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}))
AMX_FP16 = replace(AMX, flags=AMX.flags | {"amx_fp16"})


def timings(**seconds: float):
    """A probe that reports these times (and records what it was asked to time)."""
    def measure(names):
        measure.asked = tuple(names)
        return ProbeResult.of({name: seconds[name] for name in names})
    return measure


def test_avx2_without_bf16_units_gets_float32_even_if_the_probe_were_fooled():
    slow = choose_cpu_dtype(AVX2, timings(float32=1e-4, bfloat16=1.2e-2))
    fooled = choose_cpu_dtype(AVX2, timings(float32=1e-4, bfloat16=0.5e-4))
    assert slow.value == fooled.value == "float32"
    assert str(slow) == "dtype float32: CPU has AVX2, no bf16 units; bf16 probe 120x slower"


@pytest.mark.parametrize("cpu", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx"])
def test_bf16_units_that_win_the_probe_get_bfloat16(cpu):
    choice = choose_cpu_dtype(cpu, timings(float32=4e-4, bfloat16=1.6e-4))
    assert choice.value == "bfloat16"
    assert "2.5x faster" in choice.reason and ("AMX" if cpu is AMX else "AVX512_BF16") in choice.reason


def test_bf16_units_that_lose_the_probe_get_float32():
    choice = choose_cpu_dtype(AVX512_BF16, timings(float32=4e-4, bfloat16=3.9e-4))
    assert choice.value == "float32" and "1.0x faster, under the 1.1x needed" in choice.reason


def test_float16_is_a_candidate_only_with_fp16_units():
    measure = timings(float32=4e-4, bfloat16=2e-4, float16=1e-4)
    assert choose_cpu_dtype(AMX, measure).value == "bfloat16" and measure.asked == ("float32", "bfloat16")
    assert choose_cpu_dtype(AMX_FP16, measure).value == "float16" and "float16" in measure.asked


@pytest.mark.parametrize("capability, dtype", [((7, 5), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")])
def test_cuda_dtype_follows_compute_capability(capability, dtype):
    choice = choose_cuda_dtype([GpuInfo(0, "GPU", capability)])
    assert choice.value == dtype and f"sm_{capability[0]}{capability[1]}" in choice.reason


def test_cuda_dtype_suits_the_oldest_gpu_in_use():
    assert choose_cuda_dtype([GpuInfo(0, "H100", (9, 0)), GpuInfo(1, "T4", (7, 5))]).value == "float16"


@pytest.mark.parametrize("count, prefill, decode", [(0, "cpu", "cpu"), (1, "cuda:0", "cuda:0"),
                                                    (2, "cuda:0", "cuda:1"), (4, "cuda:0", "cuda:1")])
def test_devices_follow_the_visible_gpus(count, prefill, decode):
    choice = choose_devices([GpuInfo(i, "GPU", (9, 0)) for i in range(count)])
    assert (choice.prefill, choice.decode) == (prefill, decode)


def test_probe_picks_float32_where_bf16_is_emulated():
    """The real probe, with bf16 made ~120x slower than float32 by a fake clock."""
    cost = {"float32": 1e-4, "bfloat16": 1.2e-2}
    now, calls = [0.0], []

    def call(name):
        def run():
            calls.append(name)
            now[0] += cost[name]
        return run

    result = defaults.probe({name: call(name) for name in cost}, clock=lambda: now[0])
    assert result.speedup("bfloat16") == pytest.approx(1 / 120)
    assert calls.count("bfloat16") == 3                                   # the budget spent after three turns
    assert choose_cpu_dtype(AVX512_BF16, lambda names: result).value == "float32"


def test_probe_keeps_a_candidate_whose_warm_up_and_one_more_call_were_slow():
    """bf16 twice 20x slow (its warm-up, then one interrupted call), then 2x faster than float32: it stays."""
    cost = {"float32": [1e-3] * 20, "bfloat16": [2e-2, 2e-2] + [5e-4] * 18}
    now = [0.0]

    def call(name):
        def run():
            now[0] += cost[name].pop(0)
        return run

    result = defaults.probe({name: call(name) for name in cost}, clock=lambda: now[0])
    assert result.speedup("bfloat16") == pytest.approx(2.0)


def test_probe_on_this_machine_times_every_candidate():
    result = defaults.probe_matmul(("float32", "bfloat16"))
    assert all(0 < t < 1 for _, t in result.seconds)
    assert choose_cpu_dtype(defaults.detect_cpu()).value in ("float32", "bfloat16")


def test_cpuinfo_flags_are_read(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 amx_bf16\n\n"
                       "processor\t: 1\nflags\t\t: other\n")
    cpu = defaults.detect_cpu(cpuinfo)
    assert cpu.model == "Test CPU" and cpu.units("bfloat16") == "AMX" and cpu.units("float16") is None


def test_options_override_the_defaults_and_each_default_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.engine.units.layout"):
        chosen = Machine.here(EngineConfig())
    assert chosen.prefill == (torch.device("cpu"),) and chosen.dtype in (torch.float32, torch.bfloat16)
    assert any(r.message.startswith("devices prefill cpu, decode cpu: no GPU visible") for r in caplog.records)
    assert any(r.message.startswith("dtype ") and ": CPU has " in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdserve.engine.units.layout"):
        forced = Machine.here(EngineConfig(dtype="float16", prefill_device="cpu", decode_device="cpu"))
    assert forced.dtype == torch.float16 and not caplog.records
