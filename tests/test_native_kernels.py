"""The native CPU kernels (kernels/csrc) against the plain-torch references and float64 loops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.kernels import native
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.native_decode_attention import decode_attention_native
from pdserve.kernels.native_linear import linear_native
from pdserve.kernels.native_rms_norm import rms_norm_native
from pdserve.kernels.native_rotary_store import rotary_store_native, rotary_store_ref
from pdserve.kernels.native_silu_and_mul import silu_and_mul_native
from pdserve.kernels.prefill_attention import prefill_attention_ref
from pdserve.kernels.rms_norm import rms_norm_ref
from tests.conftest_kernels import (
    LAYER,
    cu_seqlens_of,
    make_paged_batch,
    naive_decode,
    rel_err,
)

pytestmark = pytest.mark.skipif(native.cpu_kernels() is None, reason="no C++ compiler: the native kernels cannot build")

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens, block_size, kv_heads, q_heads, head_dim", [
    ([5, 17, 1, 40, 0, 16], 16, 2, 6, 64),      # ragged, partial blocks, an empty context, a full block
    ([300], 16, 3, 9, 64),                      # one long sequence: split over threads
    ([1000, 3, 64], 32, 1, 8, 128),             # MQA, head_dim 128
    ([7, 9], 8, 4, 4, 32),                      # MHA, small blocks, head_dim 32 (the generic path)
    ([130, 2], 16, 2, 10, 80),                  # head_dim 80: 5 vectors of 16
    ([40, 21], 16, 2, 4, 256),                  # Gemma's 256
    ([70, 5], 16, 1, 4, 512),                   # Gemma 4's full layers: 32 vectors
])
def test_decode_attention_matches_reference(dtype, lens, block_size, kv_heads, q_heads, head_dim, threads):
    pool, tables, context_lens = make_paged_batch(lens, block_size, kv_heads, head_dim, dtype, seed=len(lens))
    q = torch.randn(len(lens), q_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = decode_attention_native(q, pool, LAYER, tables, context_lens, head_dim ** -0.5)
    expected = decode_attention_ref(q.float(), pool.float(), LAYER, tables, context_lens, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert torch.all(out[context_lens == 0] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap, has_sinks", [(20, 0.0, False), (1, 0.0, False), (0, 0.4, False),
                                                        (0, 0.0, True), (37, 0.6, True)])
def test_decode_attention_layer_kinds_match_reference(dtype, window, softcap, has_sinks, threads):
    """Sliding windows (one of a single token), soft-capped scores, sinks: split and unsplit, verify-step runs."""
    pool, tables, lens = make_paged_batch([300, 40, 20, 0], 16, 3, 64, dtype, seed=6)
    repeats, row_lens = [5, 1, 10, 1], [list(range(296, 301)), [40], list(range(11, 21)), [0]]
    rows_tables = torch.cat([tables[i:i + 1].expand(n, -1) for i, n in enumerate(repeats)]).contiguous()
    rows_lens = torch.tensor(sum(row_lens, []), dtype=torch.int32)
    q = torch.randn(len(rows_lens), 9, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    options = dict(window=window, softcap=softcap, sinks=torch.randn(9) * 2 if has_sinks else None)
    out = decode_attention_native(q, pool, LAYER, rows_tables, rows_lens, 0.125, **options)
    expected = decode_attention_ref(q.float(), pool.float(), LAYER, rows_tables, rows_lens, 0.125, **options)
    assert rel_err(out, expected) < TOLERANCE[dtype]
    if dtype == torch.float32:
        assert rel_err(out, naive_decode(q, pool, rows_tables, rows_lens, 0.125, **options)) < 1e-6
    assert torch.all(out[rows_lens == 0] == 0)


def test_decode_attention_matches_float64_loops(threads):
    pool, tables, lens = make_paged_batch([33, 1, 70], 16, 2, 64, torch.float32, seed=3)
    q = torch.randn(3, 4, 64)
    out = decode_attention_native(q, pool, LAYER, tables, lens, 0.125)
    assert rel_err(out, naive_decode(q, pool, tables, lens, 0.125)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_rows_sharing_a_block_table_each_see_their_own_positions(dtype, threads):
    """A verify step's rows: one sequence's table repeated, lengths growing by one (runs longer than the
    kernel's MAX_ROWS too), between rows of other tables."""
    pool, tables, lens = make_paged_batch([300, 40, 20], 16, 3, 64, dtype, seed=5)
    repeats, row_lens = [5, 1, 10], [list(range(296, 301)), [40], list(range(11, 21))]
    rows_tables = torch.cat([tables[i:i + 1].expand(n, -1) for i, n in enumerate(repeats)]).contiguous()
    rows_lens = torch.tensor(sum(row_lens, []), dtype=torch.int32)
    q = torch.randn(len(rows_lens), 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = decode_attention_native(q, pool, LAYER, rows_tables, rows_lens, 0.125)
    expected = decode_attention_ref(q.float(), pool.float(), LAYER, rows_tables, rows_lens, 0.125)
    assert rel_err(out, expected) < TOLERANCE[dtype]
    if dtype == torch.float32:
        assert rel_err(out, naive_decode(q, pool, rows_tables, rows_lens, 0.125)) < 1e-6


def test_decode_attention_reads_only_its_layer_and_blocks():
    pool, tables, lens = make_paged_batch([20, 5], 16, 2, 64, torch.float32, seed=4)
    q = torch.randn(2, 4, 64)
    before = decode_attention_native(q, pool, LAYER, tables, lens, 0.125)
    used = set(tables[0, :2].tolist()) | {int(tables[1, 0])}
    unused = [b for b in range(pool.shape[0]) if b not in used]
    pool[unused] = float("nan")                  # other blocks
    pool[:, 1 - LAYER] = float("nan")            # the other layer
    tables[0, 2:], tables[1, 1:] = -1, 12345     # entries past each sequence's blocks
    assert torch.equal(decode_attention_native(q, pool, LAYER, tables, lens, 0.125), before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [*range(1, 10), 17, 64])       # every tile of x rows, and several tiles
@pytest.mark.parametrize("in_features", [40, 200, 613])         # K: under 2 steps, a tail of 8, an odd tail
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(dtype, rows, in_features, bias, threads):
    gen = torch.Generator().manual_seed(rows * in_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(97, in_features, generator=gen).to(dtype)  # 97 rows: whole tiles and a rest
    b = torch.randn(97, generator=gen).to(dtype) if bias else None
    out = linear_native(x, weight, b)
    assert out.dtype == dtype and out.shape == (rows, 97)
    assert rel_err(out, F.linear(x.double(), weight.double(), None if b is None else b.double())) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_linear_with_fewer_weight_rows_than_a_tile(dtype, rows, threads):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen).to(dtype), torch.randn(3, 96, generator=gen).to(dtype)
    assert rel_err(linear_native(x, weight), F.linear(x.double(), weight.double())) < TOLERANCE[dtype]


def test_linear_reads_rows_with_a_stride():
    x = torch.randn(5, 300)[:, :256]              # x.stride(0) == 300
    weight = torch.randn(48, 256)
    assert rel_err(linear_native(x, weight), F.linear(x.double(), weight.double())) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_matches_reference(dtype, rows, threads):
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    assert rel_err(rms_norm_native(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)) < TOLERANCE[dtype]
    out, summed = rms_norm_native(x, weight, 1e-5, residual)
    expected_out, expected_sum = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_sum)
    assert rel_err(out, expected_out) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype, threads):
    x = (3 * torch.randn(40, 2 * 1000)).to(dtype)
    assert rel_err(silu_and_mul_native(x), silu_and_mul_ref(x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))   # the runner's inputs are int32
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_matches_reference(dtype, index_dtype, threads):
    pool, _, _ = make_paged_batch([200], 16, 2, 64, dtype)
    pool_ref = pool.clone()
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(70, (6 + 2 * 2) * 64, generator=gen).to(dtype)  # views into one projection, as in the model
    q, k, v = (t.reshape(70, -1, 64) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], dim=-1))
    positions = torch.randint(0, 500, (70,), generator=gen)
    slots = torch.randperm(pool.shape[0] * 16, generator=gen)[:70]
    slots[::7] = -1                                # padding rows: no store
    positions, slots = positions.to(index_dtype), slots.to(index_dtype)
    cos_sin = torch.cat([torch.rand(512, 32, generator=gen), torch.rand(512, 32, generator=gen)], dim=-1)
    out = rotary_store_native(q, k, v, positions, cos_sin, pool, LAYER, slots)
    expected = rotary_store_ref(q, k, v, positions, cos_sin, pool_ref, LAYER, slots)
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(pool, pool_ref) < TOLERANCE[dtype]
    assert torch.equal(pool[:, 1 - LAYER], pool_ref[:, 1 - LAYER])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_step_matches_reference(dtype):
    # chunked prefill with cached context, a fresh prompt and one-token (decode) rows in one step
    lens, q_lens = [40, 23, 9, 1, 57], [8, 23, 1, 1, 1]
    pool, tables, context_lens = make_paged_batch(lens, 16, 2, 64, dtype, seed=6)
    q = torch.randn(sum(q_lens), 6, 64).to(dtype)
    cu = cu_seqlens_of(q_lens)
    out = kernels.prefill_attention(q, pool, LAYER, cu, context_lens, tables, 0.125)
    expected = prefill_attention_ref(q.float(), pool.float(), LAYER, cu, context_lens, tables, 0.125)
    assert rel_err(out, expected) < TOLERANCE[dtype]


def test_cpu_dispatch_uses_native_kernels(monkeypatch):
    calls = []
    for name in ("decode_attention_native", "rms_norm_native", "silu_and_mul_native", "rotary_store_native",
                 "linear_native"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    pool, tables, lens = make_paged_batch([5], 16, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64)
    kernels.decode_attention(q, pool, LAYER, tables, lens, 0.125)
    kernels.rms_norm(torch.randn(2, 64), torch.ones(64), 1e-5)
    kernels.silu_and_mul(torch.randn(2, 64))
    kernels.rotary_store_kv(q, q[:, :2], q[:, :2], torch.tensor([3]), torch.rand(8, 64), pool, LAYER,
                            torch.tensor([0]))
    kernels.linear(torch.randn(1, 64), torch.randn(4096, 64))
    assert set(calls) >= {"decode_attention_native", "rms_norm_native", "silu_and_mul_native", "rotary_store_native"}
