"""Triton kernels against their torch references, on CPU under the Triton interpreter.

Outputs are NaN-poisoned before each launch, so an element a kernel fails to write shows up.
Triton fixes interpreter mode when it is first imported; if something imported it earlier in
this process without TRITON_INTERPRET=1, the cases run in a fresh pytest process instead.
On a machine with CUDA the compiled kernels are covered by test_kernels_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest_kernels import request_triton_interpreter, run_interpreted

request_triton_interpreter()

from pdserve.kernels._triton import HAS_TRITON, INTERPRETED  # noqa: E402
from pdserve.kernels.activation import (
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from pdserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from pdserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from pdserve.kernels.rotary import rotary_ref, rotary_triton
from pdserve.kernels.store_kv import store_kv_ref, store_kv_triton
from tests.conftest_kernels import (  # noqa: E402
    LAYER,
    cu_seqlens_of,
    make_paged_batch,
    poisoned_outputs,
    rel_err,
)

NO_CUDA = not torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (HAS_TRITON and NO_CUDA), reason="needs triton and no CUDA device")
in_process = pytest.mark.skipif(not INTERPRETED, reason="triton imported before TRITON_INTERPRET=1: "
                                                        "covered by test_cases_in_fresh_process")
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2}


@pytest.mark.skipif(INTERPRETED, reason="the cases run in this process")
def test_cases_in_fresh_process():
    run_interpreted(__file__)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "an output element was not written"
    assert rel_err(out, ref) < TOLERANCE[dtype]


DECODE_CASES = [  # dtype, Hq, Hkv, D, block, context lens, splits (None: default)
    (torch.float32, 8, 2, 64, 16, [1, 1000, 37], 4),
    (torch.float16, 8, 1, 128, 32, [1000, 1, 65], None),
    (torch.float16, 4, 4, 64, 32, [333, 17, 0], 3),
    (torch.float32, 2, 2, 128, 16, [129], 1),
    (torch.float16, 8, 2, 64, 8, [45, 8], 5),
]


@in_process
@pytest.mark.parametrize("dtype,hq,hkv,head_dim,block,lens,splits", DECODE_CASES)
def test_decode_attention(dtype, hq, hkv, head_dim, block, lens, splits):
    pool, tables, context_lens = make_paged_batch(lens, block, hkv, head_dim, dtype, filler=-1 if splits else 0)
    qkv = torch.randn(len(lens), hq + 2 * hkv, head_dim).to(dtype)
    q = qkv[:, :hq]  # NOTE: a strided view, as the model passes it
    with poisoned_outputs():
        out = decode_attention_triton(q, pool, LAYER, tables, context_lens, head_dim ** -0.5, num_splits=splits)
    check(out, decode_attention_ref(q, pool, LAYER, tables, context_lens, head_dim ** -0.5), dtype)


PREFILL_CASES = [  # dtype, Hq, Hkv, D, block, context lens, new tokens per sequence
    (torch.float32, 8, 2, 64, 16, [1, 1000], [1, 1000]),
    (torch.float16, 8, 1, 128, 32, [600, 37, 9, 5], [77, 37, 0, 1]),  # a sequence with no new tokens
    (torch.float32, 4, 4, 128, 32, [200, 17], [131, 17]),
    (torch.float16, 4, 4, 64, 16, [90, 3], [90, 2]),
]


@in_process
@pytest.mark.parametrize("dtype,hq,hkv,head_dim,block,lens,new", PREFILL_CASES)
def test_prefill_attention(dtype, hq, hkv, head_dim, block, lens, new):
    pool, tables, context_lens = make_paged_batch(lens, block, hkv, head_dim, dtype)
    cu = cu_seqlens_of(new)
    q = torch.randn(sum(new), hq + 2 * hkv, head_dim).to(dtype)[:, :hq]
    with poisoned_outputs():
        out = prefill_attention_triton(q, pool, LAYER, cu, context_lens, tables, head_dim ** -0.5)
    check(out, prefill_attention_ref(q, pool, LAYER, cu, context_lens, tables, head_dim ** -0.5), dtype)


LAYER_KINDS = [  # window, softcap, sinks
    (50, 0.0, False), (1, 0.0, False), (0, 0.5, False), (0, 0.0, True), (70, 0.4, True)]


@in_process
@pytest.mark.parametrize("window,softcap,has_sinks", LAYER_KINDS)
def test_decode_attention_layer_kinds(window, softcap, has_sinks):
    pool, tables, context_lens = make_paged_batch([1, 300, 37, 0], 16, 2, 64, torch.float32)
    q = torch.randn(4, 8, 64)
    options = dict(window=window, softcap=softcap, sinks=torch.randn(8) * 2 if has_sinks else None)
    for splits in (1, 3):
        with poisoned_outputs():
            out = decode_attention_triton(q, pool, LAYER, tables, context_lens, 0.125, num_splits=splits, **options)
        check(out, decode_attention_ref(q, pool, LAYER, tables, context_lens, 0.125, **options), torch.float32)


@in_process
@pytest.mark.parametrize("window,softcap,has_sinks", LAYER_KINDS)
def test_prefill_attention_layer_kinds(window, softcap, has_sinks):
    lens, new = [300, 37, 9, 150], [200, 37, 1, 70]          # chunks after a prefix; a one-token row
    pool, tables, context_lens = make_paged_batch(lens, 16, 2, 64, torch.float32)
    q = torch.randn(sum(new), 8, 64)
    options = dict(window=window, softcap=softcap, sinks=torch.randn(8) * 2 if has_sinks else None)
    with poisoned_outputs():
        out = prefill_attention_triton(q, pool, LAYER, cu_seqlens_of(new), context_lens, tables, 0.125, **options)
    check(out, prefill_attention_ref(q, pool, LAYER, cu_seqlens_of(new), context_lens, tables, 0.125, **options),
          torch.float32)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_and_mul(dtype):
    x = (torch.randn(9, 2 * 700) * 3).to(dtype)
    with poisoned_outputs():
        out = gelu_tanh_and_mul_triton(x)
    check(out, gelu_tanh_and_mul_ref(x), dtype)


@in_process
def test_attention_head_size_24():
    pool, tables, context_lens = make_paged_batch([40, 7], 16, 2, 24, torch.float32)
    q = torch.randn(47, 4, 24)
    cu = cu_seqlens_of([40, 7])
    with poisoned_outputs():
        out = prefill_attention_triton(q, pool, LAYER, cu, context_lens, tables, 0.2)
    check(out, prefill_attention_ref(q, pool, LAYER, cu, context_lens, tables, 0.2), torch.float32)
    with poisoned_outputs():
        out = decode_attention_triton(q[:2], pool, LAYER, tables, context_lens, 0.2)
    check(out, decode_attention_ref(q[:2], pool, LAYER, tables, context_lens, 0.2), torch.float32)


@in_process
@pytest.mark.parametrize("dtype,slot_dtype,head_dim", [(torch.float32, torch.int64, 64),
                                                      (torch.float16, torch.int32, 128)])
def test_store_kv(dtype, slot_dtype, head_dim):
    pool = torch.full((6, 2, 2, 16, 2, head_dim), float("nan"), dtype=dtype)
    qkv = torch.randn(9, 8, head_dim).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views
    slots = torch.randperm(96)[:9].to(slot_dtype)
    slots[[2, 7]] = -1
    expected = pool.clone()
    store_kv_ref(key, value, expected, LAYER, slots)
    store_kv_triton(key, value, pool, LAYER, slots)
    assert torch.equal(pool.isnan(), expected.isnan())  # exactly the mapped slots were written
    assert torch.equal(pool.nan_to_num(0.5), expected.nan_to_num(0.5))


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    x, weight = torch.randn(7, 300).to(dtype), torch.randn(300).to(dtype)
    residual = torch.randn(7, 300).to(dtype) if with_residual else None
    with poisoned_outputs():
        out = rms_norm_triton(x, weight, 1e-5, residual)
    ref = rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        check(out[1], ref[1], dtype)
        out, ref = out[0], ref[0]
    check(out, ref, dtype)


@in_process
@pytest.mark.parametrize("dtype,head_dim,hq,hkv", [(torch.float32, 64, 8, 2), (torch.float16, 128, 4, 4)])
def test_rotary(dtype, head_dim, hq, hkv):
    cos_sin = torch.randn(500, head_dim)
    positions = torch.tensor([0, 499, 12, 12, 300, 7, 1])
    qkv = torch.randn(7, hq + 2 * hkv, head_dim).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    with poisoned_outputs():
        q_out, k_out = rotary_triton(q, k, positions.to(torch.int32), cos_sin)
    q_ref, k_ref = rotary_ref(q, k, positions, cos_sin)
    check(q_out, q_ref, dtype)
    check(k_out, k_ref, dtype)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 1100).to(dtype)  # NOTE: two column chunks, the second partial
    with poisoned_outputs():
        out = silu_and_mul_triton(x)
    check(out, silu_and_mul_ref(x), dtype)
