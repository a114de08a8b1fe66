"""The CUDA path compiles without a GPU: every kernel, launched the way its wrapper launches it
(same arguments, constexprs, warps and stages, Triton's runtime specialization), is compiled by
Triton down to a cubin for sm_90 (H100/H200) with the ptxas Triton ships.

The compilation runs in a fresh process: Triton must be imported without TRITON_INTERPRET there.
Run directly, this module prints one JSON record per compiled kernel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TARGET_ARCH = 90
SHARED_MEMORY_LIMIT = 227 * 1024  # per block on sm_90
KERNELS = {"_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kv_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"}
MODULES = ["kernels.decode_attention", "kernels.prefill_attention", "kernels.store_kv", "kernels.rms_norm",
           "kernels.rotary", "kernels.activation"]


class _Capture:
    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _launch_wrappers() -> list:
    """Run each wrapper on small CPU tensors with its kernels replaced by recorders."""
    import kernels  # noqa: F401
    from kernels.activation import silu_and_mul_triton
    from kernels.decode_attention import decode_attention_triton
    from kernels.prefill_attention import prefill_attention_triton
    from kernels.rms_norm import rms_norm_triton
    from kernels.rotary import rotary_triton
    from kernels.store_kv import store_kv_triton

    launches = []
    for module in map(sys.modules.get, MODULES):
        for name in KERNELS & set(vars(module)):
            setattr(module, name, _Capture(getattr(module, name), launches))
    int32 = torch.int32
    for dtype, hq, hkv, dim, block in [(torch.bfloat16, 32, 8, 128, 16), (torch.bfloat16, 28, 4, 64, 8),
                                       (torch.float16, 32, 8, 128, 32)]:
        pool = torch.zeros(64, 2, 2, block, hkv, dim, dtype=dtype)
        q = torch.zeros(4, hq, dim, dtype=dtype)
        tables, lens = torch.zeros(4, 16, dtype=int32), torch.ones(4, dtype=int32)
        decode_attention_triton(q, pool, 1, tables, lens, 0.1, num_splits=4)
        prefill_attention_triton(q, pool, 1, torch.tensor([0, 1, 4], dtype=int32), lens[:2], tables[:2], 0.1)
    hidden = torch.zeros(4, 4096, dtype=torch.bfloat16)
    rms_norm_triton(hidden, hidden[0], 1e-5)
    rms_norm_triton(hidden, hidden[0], 1e-5, hidden)
    silu_and_mul_triton(hidden)
    q, k = torch.zeros(4, 32, 128, dtype=torch.bfloat16), torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    rotary_triton(q, k, torch.zeros(4, dtype=torch.int64), torch.zeros(16, 128))
    store_kv_triton(k, k, torch.zeros(4, 2, 2, 16, 8, 128, dtype=torch.bfloat16), 1, torch.zeros(4, dtype=int32))
    return launches


def _compile(fn, args: tuple, kwargs: dict) -> dict:
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
            native_specialize_impl(CUDABackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        elif isinstance(spec, str):
            attrs[(index,)] = CUDABackend.parse_attr(spec)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", TARGET_ARCH, 32), options=options)
    ptx = compiled.asm["ptx"]
    return {"kernel": fn.__name__, "constexprs": {k: v for k, v in constexprs.items() if k.isupper()},
            "shared": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"]),
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async")}


def main() -> None:
    for fn, args, kwargs in _launch_wrappers():
        print(json.dumps(_compile(fn, args, dict(kwargs))))


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = "."
    result = subprocess.run([sys.executable, "-m", "tests.test_kernels_compile"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_to_a_cubin(compiled):
    assert {record["kernel"] for record in compiled} == KERNELS
    assert all(record["cubin_bytes"] > 0 for record in compiled)


def test_shared_memory_fits_sm90(compiled):
    assert max(record["shared"] for record in compiled) <= SHARED_MEMORY_LIMIT


def test_attention_uses_tensor_cores(compiled):
    prefill = [r for r in compiled if r["kernel"] == "_prefill_kernel"]
    decode = [r for r in compiled if r["kernel"] == "_decode_split_kernel"]
    assert prefill and all(r["wgmma"] > 0 for r in prefill)
    assert decode and all(r["wgmma"] + r["mma_sync"] > 0 for r in decode)


if __name__ == "__main__":
    main()
