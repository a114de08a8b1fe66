"""Compiled Triton kernels against their torch references on CUDA, in bf16 and fp16."""
from __future__ import annotations

import pytest
import torch

from tests.conftest_kernels import request_triton_interpreter

request_triton_interpreter()  # NOTE: a no-op with CUDA; without, it keeps test_kernels_triton.py in-process

from pdserve.kernels._triton import HAS_TRITON, INTERPRETED  # noqa: E402
from pdserve.kernels.activation import (  # noqa: E402
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from pdserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton  # noqa: E402
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton  # noqa: E402
from pdserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from pdserve.kernels.rotary import rotary_ref, rotary_triton  # noqa: E402
from pdserve.kernels.store_kv import store_kv_ref, store_kv_triton  # noqa: E402
from tests.conftest_kernels import (  # noqa: E402
    LAYER,
    cu_seqlens_of,
    make_paged_batch,
    poisoned_outputs,
    rel_err,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or INTERPRETED,
                                 reason="needs CUDA and compiled triton")]
CUDA = "cuda"
DTYPES = [torch.bfloat16, torch.float16]


def check(out: torch.Tensor, ref: torch.Tensor, tolerance: float = 1e-2) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "an output element was not written"
    assert rel_err(out, ref) < tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim,block,lens", [
    (32, 8, 128, 16, [1, 4000, 37, 1000, 513]),
    (8, 1, 128, 32, [1000, 1, 65]),
    (16, 16, 64, 8, [333, 17, 2]),
    (28, 4, 128, 64, [4097, 1]),
    (32, 8, 128, 128, [257, 3000]),
])
def test_decode_attention_cuda(dtype, hq, hkv, head_dim, block, lens):
    pool, tables, context_lens = make_paged_batch(lens, block, hkv, head_dim, dtype, CUDA)
    q = torch.randn(len(lens), hq + 2 * hkv, head_dim, device=CUDA).to(dtype)[:, :hq]
    with poisoned_outputs():
        out = decode_attention_triton(q, pool, LAYER, tables, context_lens, head_dim ** -0.5)
    check(out, decode_attention_ref(q, pool, LAYER, tables, context_lens, head_dim ** -0.5))


def test_decode_attention_replays_in_cuda_graph():
    lens = [700, 5, 64, 1]
    pool, tables, context_lens = make_paged_batch(lens, 16, 8, 128, torch.bfloat16, CUDA)
    q = torch.randn(4, 32, 128, device=CUDA, dtype=torch.bfloat16)
    decode_attention_triton(q, pool, LAYER, tables, context_lens, 0.1)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q, pool, LAYER, tables, context_lens, 0.1)
    context_lens.copy_(torch.tensor([3, 5, 17, 1], dtype=torch.int32))
    q.normal_()
    graph.replay()
    check(out, decode_attention_ref(q, pool, LAYER, tables, context_lens, 0.1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim,block,lens,new", [
    (32, 8, 128, 16, [2048, 1, 900, 77], [2048, 1, 300, 77]),
    (8, 1, 64, 32, [1000, 37, 5], [1000, 37, 1]),
    (16, 16, 128, 64, [513, 129], [200, 129]),
])
def test_prefill_attention_cuda(dtype, hq, hkv, head_dim, block, lens, new):
    pool, tables, context_lens = make_paged_batch(lens, block, hkv, head_dim, dtype, CUDA)
    cu = cu_seqlens_of(new, CUDA)
    q = torch.randn(sum(new), hq + 2 * hkv, head_dim, device=CUDA).to(dtype)[:, :hq]
    with poisoned_outputs():
        out = prefill_attention_triton(q, pool, LAYER, cu, context_lens, tables, head_dim ** -0.5)
    check(out, prefill_attention_ref(q, pool, LAYER, cu, context_lens, tables, head_dim ** -0.5))


LAYER_KINDS = [(4096, 0.0, False), (128, 0.0, False), (0, 50.0, False), (0, 0.0, True), (128, 30.0, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap,has_sinks", LAYER_KINDS)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_attention_layer_kinds_cuda(dtype, window, softcap, has_sinks, head_dim):
    """Sliding windows (Mistral's 4096, gpt-oss's 128), Gemma 2's soft-cap, gpt-oss's sinks; decode and prefill."""
    lens, new = [5000, 37, 700, 1], [300, 37, 1, 1]
    pool, tables, context_lens = make_paged_batch(lens, 16, 2, head_dim, dtype, CUDA)
    options = dict(window=window, softcap=softcap,
                   sinks=torch.randn(8, device=CUDA) * 2 if has_sinks else None)
    q = torch.randn(sum(new), 8, head_dim, device=CUDA).to(dtype)
    with poisoned_outputs():
        out = decode_attention_triton(q[:4], pool, LAYER, tables, context_lens, head_dim ** -0.5, **options)
    check(out, decode_attention_ref(q[:4], pool, LAYER, tables, context_lens, head_dim ** -0.5, **options))
    cu = cu_seqlens_of(new, CUDA)
    with poisoned_outputs():
        out = prefill_attention_triton(q, pool, LAYER, cu, context_lens, tables, head_dim ** -0.5, **options)
    check(out, prefill_attention_ref(q, pool, LAYER, cu, context_lens, tables, head_dim ** -0.5, **options))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_cuda(dtype):
    x = torch.randn(37, 2 * 3000, device=CUDA).to(dtype)
    check(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cuda(dtype):
    pool = torch.full((64, 4, 2, 16, 8, 128), float("nan"), dtype=dtype, device=CUDA)
    qkv = torch.randn(300, 48, 128, device=CUDA).to(dtype)
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slots = torch.randperm(64 * 16, device=CUDA)[:300].to(torch.int32)
    slots[::7] = -1
    expected = pool.clone()
    store_kv_ref(key, value, expected, 2, slots)
    store_kv_triton(key, value, pool, 2, slots)
    assert torch.equal(pool.isnan(), expected.isnan())
    assert torch.equal(pool.nan_to_num(0.5), expected.nan_to_num(0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_cuda(dtype, with_residual):
    x, weight = torch.randn(333, 4096, device=CUDA).to(dtype), torch.randn(4096, device=CUDA).to(dtype)
    residual = torch.randn(333, 4096, device=CUDA).to(dtype) if with_residual else None
    with poisoned_outputs():
        out = rms_norm_triton(x, weight, 1e-5, residual)
    ref = rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        check(out[1], ref[1])
        out, ref = out[0], ref[0]
    check(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_cuda(dtype):
    cos_sin = torch.randn(8192, 128, device=CUDA)
    positions = torch.randint(0, 8192, (517,), device=CUDA)
    qkv = torch.randn(517, 48, 128, device=CUDA).to(dtype)
    q, k = qkv[:, :32], qkv[:, 32:40]
    with poisoned_outputs():
        q_out, k_out = rotary_triton(q, k, positions, cos_sin)
    q_ref, k_ref = rotary_ref(q, k, positions, cos_sin)
    check(q_out, q_ref)
    check(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_cuda(dtype):
    x = torch.randn(257, 2 * 14336, device=CUDA).to(dtype)
    with poisoned_outputs():
        out = silu_and_mul_triton(x)
    check(out, silu_and_mul_ref(x))
