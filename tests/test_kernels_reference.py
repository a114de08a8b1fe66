"""The plain-torch kernel references against naive loops and transformers; dispatch rules."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest_kernels import request_triton_interpreter

request_triton_interpreter()  # NOTE: before transformers imports triton, for test_kernels_triton.py

import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pdserve import kernels  # noqa: E402
from pdserve.kernels.activation import silu_and_mul_ref  # noqa: E402
from pdserve.kernels.decode_attention import decode_attention_ref  # noqa: E402
from pdserve.kernels.prefill_attention import prefill_attention_ref  # noqa: E402
from pdserve.kernels.rms_norm import rms_norm_ref  # noqa: E402
from pdserve.kernels.rotary import rotary_ref  # noqa: E402
from pdserve.kernels.store_kv import store_kv_ref  # noqa: E402
from tests.conftest_kernels import (  # noqa: E402
    LAYER,
    cu_seqlens_of,
    make_paged_batch,
    naive_decode,
    naive_prefill,
    rel_err,
)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,filler", [(4, 4, -1), (8, 2, 0), (8, 1, -1)])
def test_decode_ref_matches_naive(dtype, tol, num_q_heads, num_kv_heads, filler):
    pool, tables, lens = make_paged_batch([1, 37, 16, 70], 16, num_kv_heads, 32, dtype, filler=filler)
    q = torch.randn(4, num_q_heads, 32).to(dtype)
    out = decode_attention_ref(q, pool, LAYER, tables, lens, 0.2)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, naive_decode(q, pool, tables, lens, 0.2)) < tol


def test_decode_ref_empty_context_gives_zeros():
    pool, tables, lens = make_paged_batch([0, 5], 8, 2, 16, torch.float32)
    q = torch.randn(2, 4, 16)
    out = decode_attention_ref(q, pool, LAYER, tables, lens, 0.25)
    assert torch.equal(out[0], torch.zeros(4, 16))
    assert rel_err(out[1:], naive_decode(q[1:], pool, tables[1:], lens[1:], 0.25)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
def test_prefill_ref_matches_naive(dtype, tol, num_q_heads, num_kv_heads):
    context, new = [1, 40, 23, 9], [1, 40, 6, 1]  # fresh, fresh, chunk after a cached prefix, one token
    pool, tables, lens = make_paged_batch(context, 8, num_kv_heads, 16, dtype)
    cu = cu_seqlens_of(new)
    q = torch.randn(sum(new), num_q_heads, 16).to(dtype)
    out = prefill_attention_ref(q, pool, LAYER, cu, lens, tables, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, naive_prefill(q, pool, tables, cu, lens, 0.25)) < tol


LAYER_KINDS = {  # window, softcap, sinks: sliding window, Gemma 2's soft-capping, gpt-oss's sinks, all three
    "window": (7, 0.0, False), "softcap": (0, 0.3, False), "sinks": (0, 0.0, True), "all": (5, 0.5, True)}


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_decode_and_prefill_refs_of_every_layer_kind_match_naive(kind):
    window, softcap, has_sinks = LAYER_KINDS[kind]
    sinks = torch.randn(8) * 2 if has_sinks else None
    context, new = [1, 40, 23, 9, 30], [1, 40, 6, 1, 1]
    pool, tables, lens = make_paged_batch(context, 8, 2, 16, torch.float32)
    q = torch.randn(sum(new), 8, 16)
    options = dict(window=window, softcap=softcap, sinks=sinks)
    out = prefill_attention_ref(q, pool, LAYER, cu_seqlens_of(new), lens, tables, 0.25, **options)
    assert rel_err(out, naive_prefill(q, pool, tables, cu_seqlens_of(new), lens, 0.25, **options)) < 1e-5
    out = decode_attention_ref(q[:5], pool, LAYER, tables, lens, 0.25, **options)
    assert rel_err(out, naive_decode(q[:5], pool, tables, lens, 0.25, **options)) < 1e-5
    plain = decode_attention_ref(q[:5], pool, LAYER, tables, lens, 0.25)
    assert rel_err(out, plain) > 1e-3                                  # the option changed the result


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_ref_writes_slots_and_skips_padding(slot_dtype):
    pool = torch.randn(5, 2, 2, 8, 2, 16)
    before = pool.clone()
    key, value = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    slots = torch.tensor([3, -1, 17, 39, -1, 8], dtype=slot_dtype)
    store_kv_ref(key, value, pool, LAYER, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(pool[slot // 8, LAYER, 0, slot % 8], key[token])
            assert torch.equal(pool[slot // 8, LAYER, 1, slot % 8], value[token])
            before[slot // 8, LAYER, :, slot % 8] = pool[slot // 8, LAYER, :, slot % 8]
    assert torch.equal(pool, before)  # nothing else changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_ref_matches_transformers(dtype):
    hf = LlamaRMSNorm(300, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(300))
    x, residual = torch.randn(7, 300).to(dtype), torch.randn(7, 300).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, hf.weight, 1e-6), hf(x))
        out, summed = rms_norm_ref(x, hf.weight, 1e-6, residual)
        assert torch.equal(summed, residual + x)
        assert torch.equal(out, hf(residual + x))


def _rope_table(head_dim: int, max_positions: int, rope_parameters: dict | None = None):
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_positions, rope_theta=10000.0)
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    rope = LlamaRotaryEmbedding(config)
    positions = torch.arange(max_positions)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]
    half = head_dim // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1), cos[0], sin[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64}])
def test_rotary_ref_matches_transformers(dtype, tol, rope_parameters):
    cos_sin, cos, sin = _rope_table(64, 200, rope_parameters)
    positions = torch.tensor([0, 1, 199, 57, 57, 3])
    q, k = torch.randn(6, 8, 64).to(dtype), torch.randn(6, 2, 64).to(dtype)
    q_out, k_out = rotary_ref(q, k, positions, cos_sin)
    hf_q, hf_k = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                      cos[positions][None], sin[positions][None])
    assert q_out.dtype == k_out.dtype == dtype
    assert rel_err(q_out, hf_q[0].transpose(0, 1)) < tol
    assert rel_err(k_out, hf_k[0].transpose(0, 1)) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_ref(dtype):
    x = torch.randn(5, 2 * 96).to(dtype)
    expected = F.silu(x[:, :96].double()) * x[:, 96:].double()
    out = silu_and_mul_ref(x)
    assert out.dtype == dtype and out.shape == (5, 96)
    assert rel_err(out, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_cpu_tensors_do_not_use_triton(monkeypatch):
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "silu_and_mul_triton", lambda x: pytest.fail("triton path on CPU"))
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_ref(x))  # native or reference
    assert not kernels.use_triton(x)


def test_env_forces_a_path(monkeypatch):
    x = torch.randn(2, 4)
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    assert kernels.use_triton(x) == kernels.HAS_TRITON
    assert not kernels.use_native(x)
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    assert not kernels.use_triton(x) and not kernels.use_native(x)


def test_import_without_triton_uses_reference_unless_triton_is_forced():
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch, kernels\n"
              "assert not kernels.HAS_TRITON\n"
              "x = torch.randn(4, 16)\n"
              "out = kernels.rms_norm(x, torch.ones(16), 1e-6)\n"
              "assert out.shape == (4, 16)\n"
              "print('ok')\n")
    results = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={"PYTHONPATH": ".", **forced}, timeout=120, cwd=Path(__file__).resolve().parents[1])
               for forced in ({}, {"PDSERVE_KERNELS": "triton"})]
    assert results[0].stdout.strip() == "ok", results[0].stderr
    assert results[1].returncode != 0 and "KernelBackendError: PDSERVE_KERNELS=triton: Triton is not importable" \
        in results[1].stderr
