"""The CUDA path compiles without a GPU, for every target pdserve supports: each kernel, launched the
way its wrapper launches it for that target (same arguments, constexprs, warps, stages and tile
choice, Triton's runtime specialization), is compiled by Triton down to a cubin for sm_80 (A100),
sm_86 (RTX 30, A10), sm_89 (RTX 40, L4) and sm_90 (H100/H200) with the ptxas Triton ships, and its
shared memory is checked against that target's per-block limit.

The compilation runs in fresh processes: Triton must be imported without TRITON_INTERPRET there.
Run directly (`python -m tests.test_kernels_compile 86 90`), this module prints one JSON record per
compiled kernel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

TARGETS = (80, 86, 89, 90)
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}   # opt-in, per block
KERNELS = {"_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kv_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_gelu_tanh_and_mul_kernel",
           "_conv_kernel", "_conv_state_kernel", "_recurrent_kernel"}
MODULES = ["pdserve.kernels.decode_attention", "pdserve.kernels.prefill_attention", "pdserve.kernels.store_kv", "pdserve.kernels.rms_norm",
           "pdserve.kernels.rotary", "pdserve.kernels.activation", "pdserve.kernels.gated_delta_triton"]
# (dtype, q heads, kv heads, head_dim, block size, targets): every 2-byte row of the prefill tile table
# and its fp32 head_dim 128 row (kernels/prefill_attention.py says why the other fp32 rows need no more).
# NOTE: fp32 (no tensor cores) compiles to the same code and shared memory on every target, so it is
# checked where its tiles meet the tightest limits; head_dim 256 (no supported model has it) likewise.
ATTENTION_SHAPES = [("bfloat16", 32, 8, 128, 16, TARGETS), ("bfloat16", 28, 4, 64, 8, TARGETS),
                    ("bfloat16", 16, 8, 256, 16, (86, 90)), ("float32", 32, 8, 128, 16, (80, 86))]
HALVES = ((86, 89), (80, 90))        # two compile processes of about equal work

class _Capture:
    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _launch_wrappers(arch: int) -> list:
    """Run each wrapper on small CPU tensors, as it would launch for `arch`, with its kernels recorded."""
    from pdserve import kernels  # noqa: F401
    from pdserve.kernels.activation import gelu_tanh_and_mul_triton, silu_and_mul_triton
    from pdserve.kernels.decode_attention import decode_attention_triton
    from pdserve.kernels.gated_delta_triton import causal_conv1d_triton, gated_delta_rule_triton
    from pdserve.kernels.prefill_attention import prefill_attention_triton
    from pdserve.kernels.rms_norm import rms_norm_triton
    from pdserve.kernels.rotary import rotary_triton
    from pdserve.kernels.store_kv import store_kv_triton

    launches = []
    for module in map(sys.modules.get, MODULES):
        for name in KERNELS & set(vars(module)):
            kernel = getattr(module, name)
            setattr(module, name, _Capture(getattr(kernel, "fn", kernel) if isinstance(kernel, _Capture) else kernel,
                                           launches))
        if hasattr(module, "target_arch"):
            module.target_arch = lambda device: arch
    int32 = torch.int32
    for dtype_name, hq, hkv, dim, block, targets in ATTENTION_SHAPES:
        if arch not in targets:
            continue
        dtype = getattr(torch, dtype_name)
        pool = torch.zeros(64, 2, 2, block, hkv, dim, dtype=dtype)
        q = torch.zeros(4, hq, dim, dtype=dtype)
        tables, lens = torch.zeros(4, 16, dtype=int32), torch.ones(4, dtype=int32)
        cu = torch.tensor([0, 1, 4], dtype=int32)
        decode_attention_triton(q, pool, 1, tables, lens, 0.1, num_splits=4)
        prefill_attention_triton(q, pool, 1, cu, lens[:2], tables[:2], 0.1)
        kinds = dict(window=64, softcap=50.0, sinks=torch.zeros(hq))     # sliding, Gemma 2, gpt-oss layers
        decode_attention_triton(q, pool, 1, tables, lens, 0.1, num_splits=4, **kinds)
        prefill_attention_triton(q, pool, 1, cu, lens[:2], tables[:2], 0.1, **kinds)
    hidden = torch.zeros(4, 4096, dtype=torch.bfloat16)
    rms_norm_triton(hidden, hidden[0], 1e-5)
    rms_norm_triton(hidden, hidden[0], 1e-5, hidden)
    silu_and_mul_triton(hidden)
    gelu_tanh_and_mul_triton(hidden)
    q, k = torch.zeros(4, 32, 128, dtype=torch.bfloat16), torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    rotary_triton(q, k, torch.zeros(4, dtype=torch.int64), torch.zeros(16, 128))
    store_kv_triton(k, k, torch.zeros(4, 2, 2, 16, 8, 128, dtype=torch.bfloat16), 1, torch.zeros(4, dtype=int32))
    _launch_gated_delta(causal_conv1d_triton, gated_delta_rule_triton)
    return launches


def _launch_gated_delta(causal_conv1d_triton, gated_delta_rule_triton) -> None:
    """Qwen3-Next's linear-attention layer: decode and prefill of the conv (8192 channels, kernel 4) and the
    delta rule (16 key heads, 32 value heads of 128), on strided row slices as the model passes them."""
    bf16, slots, cu = torch.bfloat16, torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1, 4], dtype=torch.int32)
    projection = torch.zeros(4, 12352, dtype=bf16)
    x, weight = projection[:, :8192], torch.zeros(8192, 1, 4, dtype=bf16)[:, 0]
    conv_states = torch.zeros(4, 8192, 3)
    causal_conv1d_triton(x, weight, conv_states, torch.zeros(4, dtype=torch.int64))
    causal_conv1d_triton(x, weight, conv_states, slots, cu)
    q, k = x[:, :2048].reshape(4, 16, 128), x[:, 2048:4096].reshape(4, 16, 128)
    v, g = x[:, 4096:].reshape(4, 32, 128), torch.zeros(4, 32)
    states = torch.zeros(4, 32, 128, 128)
    gated_delta_rule_triton(q, k, v, g, projection[:, -32:], states, torch.zeros(4, dtype=torch.int64))
    gated_delta_rule_triton(q, k, v, g, projection[:, -32:], states, slots, cu)


def _compile(fn, args: tuple, kwargs: dict, arch: int) -> dict:
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    values = {**dict(zip(fn.arg_names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        kind, spec = ("constexpr", value) if param.is_constexpr else \
            native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        elif isinstance(spec, str):
            attrs[(index,)] = CUDABackend.parse_attr(spec)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    ptx = compiled.asm["ptx"]
    return {"arch": arch, "kernel": fn.__name__, "options": options,
            "constexprs": {k: v for k, v in constexprs.items() if k.isupper()},
            "shared": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"]),
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async")}


def main(archs: list[int]) -> None:
    for arch in archs:
        for fn, args, kwargs in _launch_wrappers(arch):
            print(json.dumps(_compile(fn, args, dict(kwargs), arch)), flush=True)


def _compile_in_subprocess(archs: tuple[int, ...]) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = "."
    env["PDSERVE_KERNELS"] = "triton"       # Triton is imported without a CUDA device only when asked for
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-m", "tests.test_kernels_compile", *map(str, archs)],
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia.compiler")
    with ThreadPoolExecutor(len(HALVES)) as pool:       # NOTE: one process per core of a 2-core CI box
        return [record for part in pool.map(_compile_in_subprocess, HALVES) for record in part]


def test_every_kernel_compiles_to_a_cubin_for_every_target(compiled):
    for arch in TARGETS:
        records = [r for r in compiled if r["arch"] == arch]
        assert {r["kernel"] for r in records} == KERNELS, arch
        assert all(r["cubin_bytes"] > 0 for r in records)


@pytest.mark.parametrize("arch", TARGETS)
def test_shared_memory_fits_the_target(compiled, arch):
    over = [(r["kernel"], r["constexprs"], r["options"], r["shared"]) for r in compiled
            if r["arch"] == arch and r["shared"] > SHARED_MEMORY_LIMITS[arch]]
    assert not over, f"sm_{arch} allows {SHARED_MEMORY_LIMITS[arch]} bytes per block: {over}"


def test_the_limits_are_the_ones_the_kernels_choose_tiles_by():
    from pdserve.kernels._triton import shared_memory_limit

    assert {arch: shared_memory_limit(arch) for arch in TARGETS} == SHARED_MEMORY_LIMITS


def test_the_99kb_targets_get_smaller_fp32_tiles():
    from pdserve.kernels.prefill_attention import tile_configs

    def area(arch):
        best = tile_configs(128, 4, arch)[0]
        return best["BLOCK_M"] * best["BLOCK_N"]

    assert area(86) == area(89) < area(80) == area(90)


def test_attention_uses_tensor_cores(compiled):
    prefill = [r for r in compiled if r["kernel"] == "_prefill_kernel" and not r["constexprs"]["DOT_FP32"]]
    decode = [r for r in compiled if r["kernel"] == "_decode_split_kernel" and not r["constexprs"]["DOT_FP32"]]
    assert prefill and all(r["wgmma"] > 0 for r in prefill if r["arch"] == 90)
    assert all(r["mma_sync"] > 0 for r in prefill if r["arch"] != 90)
    assert decode and all(r["wgmma"] + r["mma_sync"] > 0 for r in decode)


if __name__ == "__main__":
    main([int(arch) for arch in sys.argv[1:]] or list(TARGETS))
