"""A Gated DeltaNet layer's stateful ops: the torch references (kernels/gated_delta.py) against a naive per-token
loop in float64 and against transformers' Qwen3-Next functions; the Triton kernels (kernels/gated_delta_triton.py)
against the references under TRITON_INTERPRET=1 (outputs NaN-poisoned), and compiled on CUDA.

Each case is a packed prefill of sequences of different lengths (1, over one chunk of 64, over two) starting from
non-zero states in shuffled slots, then decode steps continuing the same states; states are compared whole, so a
slot no sequence owns must come back untouched."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest_kernels import cu_seqlens_of, poisoned_outputs, rel_err, request_triton_interpreter

request_triton_interpreter()

from pdserve import kernels  # noqa: E402
from pdserve.kernels._triton import HAS_TRITON, INTERPRETED  # noqa: E402
from pdserve.kernels.gated_delta import causal_conv1d_ref, gated_delta_rule_ref  # noqa: E402
from pdserve.kernels.gated_delta_triton import causal_conv1d_triton, gated_delta_rule_triton  # noqa: E402

interpreted = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED) or torch.cuda.is_available(),
                                 reason="needs triton under TRITON_INTERPRET=1 and no CUDA device")

LENGTHS = [1, 70, 5, 130, 2]
NUM_SLOTS = 8
SLOTS = [6, 0, 3, 7, 1]            # slots 2, 4, 5 belong to no sequence
DECODE_STEPS = 2


def conv_inputs(lengths, channels, kernel, dtype=torch.float32, device="cpu", seed=0):
    """x [T, C] as a strided view (the model passes a slice of its projection), weight [C, K], conv states."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    x = torch.randn(tokens, channels + 8, generator=gen)[:, :channels]
    weight = torch.randn(channels, 1, kernel, generator=gen)[:, 0] * 0.5
    states = torch.randn(NUM_SLOTS, channels, kernel - 1, generator=gen)
    return x.to(device, dtype), weight.to(device, dtype), states.to(device)


def delta_inputs(tokens, key_heads, value_heads, key_dim, value_dim, dtype=torch.float32, device="cpu", seed=0):
    """q, k [T, Hk, Dk], v [T, Hv, Dv] as strided views of one packed row (as the model splits them), g [T, Hv]
    (log decays, <= 0), beta [T, Hv] in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    qk = key_heads * key_dim
    packed = torch.randn(tokens, 2 * qk + value_heads * value_dim, generator=gen).to(device, dtype)
    q = packed[:, :qk].reshape(tokens, key_heads, key_dim)
    k = packed[:, qk:2 * qk].reshape(tokens, key_heads, key_dim)
    v = packed[:, 2 * qk:].reshape(tokens, value_heads, value_dim)
    g = (-torch.rand(tokens, value_heads, generator=gen) * 0.3).to(device)
    beta = torch.rand(tokens, value_heads, generator=gen).to(device, dtype)
    return q, k, v, g, beta


def delta_states(value_heads, key_dim, value_dim, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_SLOTS, value_heads, key_dim, value_dim, generator=gen) * 0.3).to(device)


def naive_conv(x, weight, states, slots, lengths):
    """Per token: silu of the weighted sum over the last K inputs (the slot's state, then the sequence's tokens)."""
    kernel = weight.shape[1]
    out, states = torch.zeros(x.shape, dtype=torch.float64), states.double().clone()
    start = 0
    for slot, count in zip(slots, lengths):
        window = torch.cat([states[slot], x[start:start + count].double().T], dim=1)
        for i in range(count):
            out[start + i] = F.silu((window[:, i:i + kernel] * weight.double()).sum(dim=1))
        states[slot] = window[:, window.shape[1] - (kernel - 1):]
        start += count
    return out, states


def naive_delta_rule(q, k, v, g, beta, states, slots, lengths):
    """Per sequence, token and value head in float64: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * q.shape[-1] ** -0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    out, states = torch.zeros(v.shape, dtype=torch.float64), states.double().clone()
    group = v.shape[1] // k.shape[1]
    start = 0
    for slot, count in zip(slots, lengths):
        for t in range(start, start + count):
            for head in range(v.shape[1]):
                s, key = states[slot, head] * g[t, head].exp(), k[t, head // group]
                s = s + torch.outer(key, beta[t, head] * (v[t, head] - s.T @ key))
                out[t, head], states[slot, head] = s.T @ q[t, head // group], s
        start += count
    return out, states


def test_conv_reference_matches_a_naive_loop():
    x, weight, states = conv_inputs(LENGTHS, 12, 4)
    expected, expected_states = naive_conv(x, weight, states, SLOTS, LENGTHS)
    out = causal_conv1d_ref(x, weight, states, torch.tensor(SLOTS), cu_seqlens_of(LENGTHS))
    assert torch.allclose(out.double(), expected, atol=1e-5) and torch.allclose(states.double(), expected_states)
    step = torch.randn(len(SLOTS), 12)
    expected, expected_states = naive_conv(step, weight, states, SLOTS, [1] * len(SLOTS))
    out = causal_conv1d_ref(step, weight, states, torch.tensor(SLOTS))
    assert torch.allclose(out.double(), expected, atol=1e-5) and torch.allclose(states.double(), expected_states)


def test_delta_rule_reference_matches_a_naive_loop():
    """The chunked prefill (sequences of one, two and three chunks) and the decode step, Hv = 2 Hk."""
    tokens = sum(LENGTHS)
    q, k, v, g, beta = delta_inputs(tokens + len(SLOTS), 2, 4, 16, 8)
    states = delta_states(4, 16, 8)
    prefill, decode = slice(0, tokens), slice(tokens, None)
    expected, expected_states = naive_delta_rule(q[prefill], k[prefill], v[prefill], g[prefill], beta[prefill], states,
                                                 SLOTS, LENGTHS)
    out = gated_delta_rule_ref(q[prefill], k[prefill], v[prefill], g[prefill], beta[prefill], states,
                               torch.tensor(SLOTS), cu_seqlens_of(LENGTHS))
    assert torch.allclose(out.double(), expected, atol=1e-4) and torch.allclose(states.double(), expected_states,
                                                                               atol=1e-4)
    expected, expected_states = naive_delta_rule(q[decode], k[decode], v[decode], g[decode], beta[decode], states,
                                                 SLOTS, [1] * len(SLOTS))
    out = gated_delta_rule_ref(q[decode], k[decode], v[decode], g[decode], beta[decode], states, torch.tensor(SLOTS))
    assert torch.allclose(out.double(), expected, atol=1e-4) and torch.allclose(states.double(), expected_states,
                                                                               atol=1e-4)


@pytest.mark.parametrize("form", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_delta_rule_reference_matches_transformers(form):
    """transformers' Qwen3-Next functions, one sequence at a time ([1, n, H, D], q and k L2-normalised there)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    theirs = getattr(qwen3_next, form)
    tokens = sum(LENGTHS)
    q, k, v, g, beta = delta_inputs(tokens, 2, 4, 16, 8, seed=2)
    states = delta_states(4, 16, 8, seed=3)
    expected, expected_states = torch.empty_like(v), states.clone()
    start = 0
    for slot, count in zip(SLOTS, LENGTHS):
        part = slice(start, start + count)
        o, final = theirs(*(t[None, part] for t in (q, k, v, g, beta)), initial_state=states[slot][None],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        expected[part], expected_states[slot] = o[0], final[0]
        start += count
    out = gated_delta_rule_ref(q, k, v, g, beta, states, torch.tensor(SLOTS), cu_seqlens_of(LENGTHS))
    assert rel_err(out, expected) < 1e-5 and rel_err(states, expected_states) < 1e-5


def run_conv(conv, x, weight, states, lengths, device="cpu"):
    """A prefill of `lengths`, then DECODE_STEPS decode steps continuing it; the outputs, concatenated."""
    slots, cu = torch.tensor(SLOTS, device=device), cu_seqlens_of(lengths, device)
    outs = [conv(x[:sum(lengths)], weight, states, slots, cu)]
    for step in range(DECODE_STEPS):
        first = sum(lengths) + step * len(SLOTS)
        outs.append(conv(x[first:first + len(SLOTS)], weight, states, slots))
    return torch.cat(outs)


def run_delta_rule(rule, inputs, states, lengths, device="cpu"):
    """As run_conv, for the delta rule over inputs (q, k, v, g, beta) of the prefill's and the steps' tokens."""
    slots, cu = torch.tensor(SLOTS, device=device), cu_seqlens_of(lengths, device)
    prefill = sum(lengths)
    outs = [rule(*(t[:prefill] for t in inputs), states, slots, cu)]
    for step in range(DECODE_STEPS):
        rows = slice(prefill + step * len(SLOTS), prefill + (step + 1) * len(SLOTS))
        outs.append(rule(*(t[rows] for t in inputs), states, slots))
    return torch.cat(outs)


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,kernel", [(40, 4), (160, 3)])      # 160: two channel blocks, the second partial
def test_triton_conv_matches_reference(dtype, channels, kernel):
    x, weight, states = conv_inputs(LENGTHS + [1] * DECODE_STEPS * len(SLOTS), channels, kernel, dtype)
    ref_states = states.clone()
    with poisoned_outputs():
        out = run_conv(causal_conv1d_triton, x, weight, states, LENGTHS)
    expected = run_conv(causal_conv1d_ref, x, weight, ref_states, LENGTHS)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, expected) < TOLERANCE[dtype] and torch.allclose(states, ref_states, atol=1e-6)


@interpreted
def test_triton_conv_leaves_an_empty_sequence_state_alone():
    lengths = [3, 0, 17]
    x, weight, states = conv_inputs(lengths, 8, 4)
    slots, before = torch.tensor(SLOTS[:3]), states.clone()
    causal_conv1d_triton(x, weight, states, slots, cu_seqlens_of(lengths))
    assert torch.equal(states[SLOTS[1]], before[SLOTS[1]])
    assert torch.equal(states[SLOTS[2]], x[3:].float().T[:, -3:])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_heads,value_heads,key_dim,value_dim", [(2, 4, 16, 16), (1, 2, 12, 40)])
def test_triton_delta_rule_matches_reference(dtype, key_heads, value_heads, key_dim, value_dim):
    """Hv = 2 Hk; (12, 40): head sizes no power of two, the value columns in two blocks, the second partial."""
    inputs = delta_inputs(sum(LENGTHS) + DECODE_STEPS * len(SLOTS), key_heads, value_heads, key_dim, value_dim, dtype)
    states = delta_states(value_heads, key_dim, value_dim)
    ref_states = states.clone()
    with poisoned_outputs():
        out = run_delta_rule(gated_delta_rule_triton, inputs, states, LENGTHS)
    expected = run_delta_rule(gated_delta_rule_ref, inputs, ref_states, LENGTHS)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, expected) < TOLERANCE[dtype] and rel_err(states, ref_states) < 1e-5


def test_dispatch_takes_triton_only_for_the_triton_backend(monkeypatch):
    calls = []
    for name in ("causal_conv1d_triton", "gated_delta_rule_triton", "causal_conv1d_ref", "gated_delta_rule_ref"):
        monkeypatch.setattr(kernels, name, lambda *args, name=name: calls.append(name))
    x, weight, states = conv_inputs([1], 8, 4)
    q, k, v, g, beta = delta_inputs(1, 1, 2, 8, 8)
    for backend in kernels.Backend:
        kernels.causal_conv1d(x, weight, states, torch.tensor([0]), backend=backend)
        kernels.gated_delta_rule(q, k, v, g, beta, delta_states(2, 8, 8), torch.tensor([0]), backend=backend)
    assert calls == ["causal_conv1d_ref", "gated_delta_rule_ref", "causal_conv1d_triton", "gated_delta_rule_triton",
                     "causal_conv1d_ref", "gated_delta_rule_ref"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or INTERPRETED,
                    reason="needs CUDA and compiled triton")
def test_compiled_kernels_match_reference_on_cuda():
    """Qwen3-Next's shapes and dtype: conv over 8192 channels (kernel 4), 16 key heads, 32 value heads of 128."""
    dtype = torch.bfloat16
    lengths = [1, 77, 1000, 130, 3]
    x, weight, conv_states = conv_inputs(lengths + [1] * DECODE_STEPS * len(SLOTS), 8192, 4, dtype, "cuda")
    ref_conv_states = conv_states.clone()
    with poisoned_outputs():
        out = run_conv(causal_conv1d_triton, x, weight, conv_states, lengths, "cuda")
    expected = run_conv(causal_conv1d_ref, x, weight, ref_conv_states, lengths, "cuda")
    assert not out.isnan().any() and rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(conv_states, ref_conv_states) < 1e-6
    inputs = delta_inputs(x.shape[0], 16, 32, 128, 128, dtype, "cuda")
    states = delta_states(32, 128, 128, "cuda")
    ref_states = states.clone()
    with poisoned_outputs():
        out = run_delta_rule(gated_delta_rule_triton, inputs, states, lengths, "cuda")
    expected = run_delta_rule(gated_delta_rule_ref, inputs, ref_states, lengths, "cuda")
    assert not out.isnan().any() and rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(states, ref_states) < 1e-3

