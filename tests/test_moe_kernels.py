"""The experts of a mixture-of-experts layer, grouped by expert: the torch reference (index_select / index_add,
one matmul per expert touched) against every expert run on every token and the chosen ones summed, in
float64; the Triton grouped GEMM against the reference under TRITON_INTERPRET=1 (outputs NaN-poisoned);
and the weights each reads: an expert no row chose is never touched."""
from __future__ import annotations

import pytest
import torch

from tests.conftest_kernels import poisoned_outputs, rel_err, request_triton_interpreter

request_triton_interpreter()

from pdserve import kernels  # noqa: E402
from pdserve.kernels import grouped_gemm  # noqa: E402
from pdserve.kernels._triton import HAS_TRITON, INTERPRETED  # noqa: E402
from pdserve.kernels.grouped_gemm import align_pairs, moe_experts_triton  # noqa: E402
from pdserve.kernels.moe import expert_activation, moe_experts_ref  # noqa: E402

interpreted = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED) or torch.cuda.is_available(),
                                 reason="needs triton under TRITON_INTERPRET=1 and no CUDA device")


def experts(num: int, hidden: int, inter: int, dtype=torch.float32, bias: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    b13 = (torch.randn(num, 2 * inter, generator=g) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(num, hidden, generator=g) * 0.1).to(dtype) if bias else None
    return w13, w2, b13, b2


def routed(tokens: int, num: int, top_k: int, allowed: list[int] | None = None, seed: int = 1):
    """Each token's top_k distinct experts (from `allowed`, else all) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(allowed if allowed is not None else list(range(num)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return ids.reshape(tokens, top_k), weights


def every_expert(x, w13, w2, ids, weights, b13, b2, activation, alpha=1.702, limit=7.0):
    """Every expert on every token in float64, then each token's chosen ones weighted and summed."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        gate_up = x64 @ w13[e].double().T + (0 if b13 is None else b13[e].double())
        y = expert_activation(gate_up, activation, alpha, limit) @ w2[e].double().T
        y = y + (0 if b2 is None else b2[e].double())
        out += (weights.double() * (ids == e)).sum(dim=1, keepdim=True) * y
    return out


CASES = [  # tokens, experts, top_k, hidden, intermediate, bias, activation
    (1, 8, 2, 64, 32, False, "silu"),
    (7, 8, 2, 48, 40, True, "swiglu_clamped"),
    (70, 16, 4, 64, 96, False, "silu"),
    (33, 4, 1, 32, 16, True, "silu"),
]


@pytest.mark.parametrize("tokens,num,top_k,hidden,inter,bias,activation", CASES)
def test_reference_is_every_expert_weighted(tokens, num, top_k, hidden, inter, bias, activation):
    w13, w2, b13, b2 = experts(num, hidden, inter, bias=bias)
    ids, weights = routed(tokens, num, top_k)
    x = torch.randn(tokens, hidden)
    ours = moe_experts_ref(x, w13, w2, ids, weights, b13, b2, activation=activation, limit=0.5)
    expected = every_expert(x, w13, w2, ids, weights, b13, b2, activation, limit=0.5)
    assert expected.abs().max() > 0.1
    assert (ours.double() - expected).abs().max() < 1e-5


def test_swiglu_clamped_is_gpt_oss_activation():
    """transformers' GptOssExperts._apply_gate on interleaved gate/up columns, ours on [gate | up] halves."""
    import transformers

    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=2, swiglu_limit=0.7)
    theirs = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    interleaved = torch.randn(5, 16) * 2
    halves = torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], dim=-1)
    ours = expert_activation(halves, "swiglu_clamped", config.swiglu_alpha, config.swiglu_limit)
    assert torch.allclose(ours, theirs._apply_gate(interleaved), atol=1e-6)


@pytest.mark.parametrize("block_m", [16, 64])
def test_aligned_pairs_cover_each_pair_once_in_its_experts_blocks(block_m):
    ids, _ = routed(37, 16, 3, allowed=[0, 3, 4, 9, 15])
    pair_ids, block_experts = align_pairs(ids, 16, block_m)
    flat = ids.reshape(-1)
    real = pair_ids < flat.numel()
    assert sorted(pair_ids[real].tolist()) == list(range(flat.numel()))
    blocks = pair_ids.view(-1, block_m)
    for block, expert in zip(blocks, block_experts.tolist()):
        members = block[block < flat.numel()]
        if expert < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (flat[members.long()] == expert).all()
    assert set(block_experts[block_experts >= 0].tolist()) == {0, 3, 4, 9, 15}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,num,top_k,hidden,inter,bias,activation", CASES)
def test_triton_grouped_gemm_matches_reference(tokens, num, top_k, hidden, inter, bias, activation, dtype):
    w13, w2, b13, b2 = experts(num, hidden, inter, dtype, bias=bias)
    ids, weights = routed(tokens, num, top_k)
    x = torch.randn(tokens, hidden).to(dtype)
    with poisoned_outputs():
        out = moe_experts_triton(x, w13, w2, ids, weights, b13, b2, activation=activation, limit=0.5)
    ref = moe_experts_ref(x.float(), w13.float(), w2.float(), ids, weights, None if b13 is None else b13.float(),
                          None if b2 is None else b2.float(), activation=activation, limit=0.5)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out.float(), ref) < (1e-4 if dtype == torch.float32 else 1e-2)


def touched_experts(monkeypatch, module, attribute: str) -> list[int]:
    """The experts whose weights `module.attribute` (a kernel taking w13/w2 slices or block_experts) reads."""
    seen = []
    real = getattr(module, attribute)

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attribute, spy)
    return seen


def test_reference_reads_only_the_chosen_experts_weights(monkeypatch):
    """The bytes of expert weights one decode step of 3 rows reads, routed to experts {2, 5, 6} of 8, are those
    three experts' w13 and w2, each read once."""
    w13, w2, _, _ = experts(8, 64, 32)
    ids, weights = routed(3, 8, 2, allowed=[2, 5, 6])
    calls = []
    ours = moe_experts_ref(torch.randn(3, 64), w13, w2, ids, weights,
                           linear=lambda a, w, b: calls.append(w) or torch.nn.functional.linear(a, w, b))
    assert ours.shape == (3, 64)
    read = {(w.data_ptr(), w.numel() * w.element_size()) for w in calls}
    assert len(read) == len(calls) == 6
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    assert sum(size for _, size in read) == 3 * per_expert
    starts = {(w13[e].data_ptr(), w2[e].data_ptr()) for e in ids.unique().tolist()}
    assert {ptr for pair in starts for ptr in pair} == {ptr for ptr, _ in read}


@interpreted
def test_triton_launches_only_the_chosen_experts_blocks(monkeypatch):
    w13, w2, _, _ = experts(8, 64, 32)
    ids, weights = routed(5, 8, 2, allowed=[1, 7])
    launches = touched_experts(monkeypatch, grouped_gemm, "grouped_gemm")
    moe_experts_triton(torch.randn(5, 64), w13, w2, ids, weights)
    assert len(launches) == 2
    for args in launches:
        block_experts = args[4]
        assert set(block_experts[block_experts >= 0].tolist()) == {1, 7}


def test_dispatch_takes_the_backend_asked(monkeypatch):
    w13, w2, _, _ = experts(4, 32, 16)
    ids, weights = routed(3, 4, 2)
    x = torch.randn(3, 32)
    calls = touched_experts(monkeypatch, kernels, "moe_experts_ref")
    torch_out = kernels.moe_experts(x, w13, w2, ids, weights, backend=kernels.Backend.TORCH)
    native_out = kernels.moe_experts(x, w13, w2, ids, weights, backend=kernels.Backend.NATIVE)
    assert len(calls) == 2 and torch.allclose(torch_out, native_out, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or INTERPRETED,
                    reason="needs CUDA and compiled triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,num,top_k,hidden,inter,bias,activation",
                         CASES + [(1, 128, 8, 2048, 768, False, "silu"), (2048, 32, 4, 2880, 2880, True,
                                                                          "swiglu_clamped")])
def test_compiled_grouped_gemm_matches_reference_on_cuda(tokens, num, top_k, hidden, inter, bias, activation, dtype):
    """Decode (one row over Qwen3-30B-A3B's 128 experts) and prefill (gpt-oss-sized experts) shapes too."""
    w13, w2, b13, b2 = (None if t is None else t.cuda() for t in experts(num, hidden, inter, dtype, bias=bias))
    ids, weights = (t.cuda() for t in routed(tokens, num, top_k))
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    with poisoned_outputs():
        out = kernels.moe_experts(x, w13, w2, ids, weights, b13, b2, activation=activation, limit=0.5,
                                  backend=kernels.Backend.TRITON)
    ref = moe_experts_ref(x.float(), w13.float(), w2.float(), ids, weights, None if b13 is None else b13.float(),
                          None if b2 is None else b2.float(), activation=activation, limit=0.5)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out.float(), ref) < (1e-3 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or INTERPRETED,
                    reason="needs CUDA and compiled triton")
def test_grouped_gemm_is_captured_in_a_cuda_graph_and_replays_new_routing():
    """Nothing in the launch reads back from the device: a decode graph captures it and replays other routings."""
    w13, w2, _, _ = (None if t is None else t.cuda() for t in experts(16, 256, 128, torch.bfloat16))
    ids, weights = (t.cuda() for t in routed(8, 16, 2, seed=1))
    x = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    kernels.moe_experts(x, w13, w2, ids, weights, backend=kernels.Backend.TRITON)          # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(x, w13, w2, ids, weights, backend=kernels.Backend.TRITON)
    new_ids, new_weights = routed(8, 16, 2, seed=2)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    expected = moe_experts_ref(x.float(), w13.float(), w2.float(), ids, weights)
    assert rel_err(out.float(), expected) < 2e-2
