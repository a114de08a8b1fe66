"""The mixture-of-experts families in the model: the weights they hold and read against transformers' own
parameters, the router against transformers' router, and a decode step reading only the chosen experts."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve import kernels
from pdserve.bench import moe_bench
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.moe import route
from pdserve.engine.worker.model_runner import load_model
from pdserve.engine.worker.startup.warmup import warm_cpu_linears
from pdserve.kernels import native_linear
from pdserve.kernels.kv_layout import KVLayout
from tests.hf_models import MOE_ARCHS, reference_model
from tests.models import hf_checkpoint


def counted(model, skip=("norm", "bias", "sinks", "embed_tokens")) -> int:
    """transformers' weight count the way ModelConfig counts it: projections, router, experts and the LM head
    (norms, biases, sinks and the input embedding left out; a tied head counted once as the head)."""
    total = sum(p.numel() for n, p in model.named_parameters() if not any(s in n for s in skip))
    return total + (model.config.vocab_size * model.config.hidden_size if model.config.tie_word_embeddings else 0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_stored_and_active_weights_are_transformers_parameters(arch):
    reference, config = reference_model(hf_checkpoint(arch)), ModelConfig.from_dir(hf_checkpoint(arch))
    assert config.stored_params == counted(reference)
    e, sparse = config.experts, sum(kind.experts for kind in config.layer_kinds)
    unchosen = sparse * (e.num_experts - e.top_k) * e.expert_params(config.hidden_size)
    assert config.weight_params == counted(reference) - unchosen


@pytest.mark.parametrize("arch", [arch for arch in MOE_ARCHS if arch != "gemma4-moe"])    # test_gemma4.py
def test_routing_is_transformers_routers(arch):
    """The same top-k experts and weights as the family's own router module, on random hidden states."""
    reference, config = reference_model(hf_checkpoint(arch)), ModelConfig.from_dir(hf_checkpoint(arch))
    block = next(layer.mlp for layer in reference.model.layers if not hasattr(layer.mlp, "down_proj"))
    router = getattr(block, "gate", None) or block.router
    h = torch.randn(50, config.hidden_size) * 3
    with torch.no_grad():
        _, expected_weights, expected_ids = router(h)
        logits = torch.nn.functional.linear(h, router.weight, getattr(router, "bias", None))
    e = config.experts
    weights, ids = route(logits, e.top_k, e.routing, e.norm_topk_prob)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(weights, expected_weights.float(), atol=1e-6)
    assert len(ids.unique()) > e.top_k                     # the tokens do not all take the same experts


def decode_step(model, rows: int) -> None:
    """One decode step of `rows` sequences with one token each, over a fresh pool."""
    c = model.config
    pool = KVLayout(c.num_layers, 16, c.num_kv_heads, c.head_dim).allocate(rows, torch.float32, "cpu")
    zeros = torch.zeros(rows, dtype=torch.int64)
    batch = ForwardBatch(input_ids=torch.arange(rows) + 3, positions=zeros, slot_mapping=torch.arange(rows) * 16,
                         block_tables=torch.arange(rows, dtype=torch.int32)[:, None],
                         context_lens=torch.ones(rows, dtype=torch.int32), cu_seqlens_q=None,
                         logits_indices=torch.arange(rows))
    with torch.inference_mode():
        model.compute_logits(model(batch, pool))


@pytest.mark.parametrize("backend", [kernels.Backend.TORCH, kernels.Backend.NATIVE])
def test_a_decode_step_reads_only_the_experts_its_rows_chose(monkeypatch, backend):
    """gpt-oss's router biased so every row takes experts 1 and 6 of 8: the expert weights a 4-row decode step
    reads are exactly those two experts' w13 and w2 in every layer, each once."""
    config = ModelConfig.from_dir(hf_checkpoint("gpt-oss"))
    model = load_model(config, torch.float32, torch.device("cpu"), 64)
    model.use_backend(backend)
    chosen = [1, 6]
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.router.bias[chosen] += 100.0
    read = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None, be=None: read.append(w) or real(x, w, b, be))
    decode_step(model, rows=4)
    stacks = {p.untyped_storage().data_ptr(): p for layer in model.layers for p in (layer.mlp.w13, layer.mlp.w2)}
    expert_reads = [w for w in read if w.untyped_storage().data_ptr() in stacks]
    touched = sum(w.numel() * w.element_size() for w in expert_reads)
    per_expert = (model.layers[0].mlp.w13[0].numel() + model.layers[0].mlp.w2[0].numel()) * 4
    assert touched == config.num_layers * len(chosen) * per_expert
    assert {w.data_ptr() for w in expert_reads} == {p[e].data_ptr() for p in stacks.values() for e in chosen}


def test_the_moe_bench_compares_checkpoints_of_the_same_active_weights(tmp_path):
    """`python -m pdserve.bench.moe_bench` at toy sizes: the two checkpoints it writes read the same weights a token
    (the router aside), and each dtype's row times both."""
    out = tmp_path / "moe_bench.json"
    argv = ["--dir", str(tmp_path), "--threads", "1", "--dtypes", "float32", "--context", "20", "--iters", "1",
            "--rounds", "1", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
            "--experts", "8", "--expert-size", "32", "--top-k", "2", "--out", str(out)]
    assert moe_bench.main(argv) == 0
    moe, dense = (ModelConfig.from_dir(tmp_path / name) for name in ("moe", "dense"))
    assert moe.experts.num_experts == 8 and dense.experts is None
    assert moe.weight_params - dense.weight_params == moe.num_layers * moe.hidden_size * 8      # the routers
    row, = json.loads(out.read_text())["rows"]
    assert row["moe"]["ms"] > 0 and row["dense"]["ms"] > 0
    assert row["ratio"] == pytest.approx(row["moe"]["ms"] / row["dense"]["ms"])


def test_start_up_decides_the_native_linear_for_every_expert_and_router_shape(monkeypatch):
    """After the CPU warm-up no decode step times BLAS against the native linear for an expert's matrices."""
    model = load_model(ModelConfig.from_dir(hf_checkpoint("qwen2-moe")), torch.float32, torch.device("cpu"), 64)
    if not kernels.use_native(model.embed_tokens.weight):
        pytest.skip("no native CPU kernels here")
    model.use_backend(kernels.Backend.NATIVE)
    monkeypatch.setattr(native_linear, "_winners", {})        # decisions an earlier test made do not count
    assert warm_cpu_linears(model, (torch.get_num_threads(),)) > 0
    timed = []
    monkeypatch.setattr(native_linear, "_measure", lambda x, w, key: timed.append(key) or True)
    for rows in (1, 3):
        decode_step(model, rows)
    assert timed == []
