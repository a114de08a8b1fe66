"""Every decoder layer of a decode step in one native call: the same numbers as the per-op path.

The per-op path is the one the parity tests hold against transformers; the one-call step runs the
same native kernels in the same order, so greedy tokens and every logprob must be identical (the
linears are pinned to the native kernel on both sides, as they are whenever the step goes native).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve import kernels
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.quant_probe import ProbeResult
from pdserve.engine.model import gguf_modules, quant, quant_gguf
from pdserve.engine.worker.model_runner import load_model
from pdserve.kernels import native, native_decode_layers
from pdserve.kernels.native_decode_layers import DecodeLayers
from tests.models import demo_checkpoint, engine_config, hf_checkpoint
from tests.test_quant_model import write_gguf_model

pytestmark = pytest.mark.skipif(native.cpu_kernels() is None, reason="no C++ compiler")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT_LENGTHS = (3, 16, 17, 40)              # one under a block, a full block, one over, ragged


def generate(model, dtype: str, one_call: bool, monkeypatch, mode: str = "colocated", **config):
    monkeypatch.setattr(DecodeLayers, "serves", lambda self, rows: one_call)
    monkeypatch.setattr(native_decode_layers, "prefer_native", kernels.prefer_native)    # the head's, as linear's
    calls = []
    real = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: calls.append(len(a) > 8 and a[8] is not None) or real(*a))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    llm = LLM(config=replace(engine_config(model, mode=mode, max_prefill_tokens=24, block_size=16, **config),
                             dtype=dtype))
    try:
        outputs = llm.generate(prompts, GREEDY)
    finally:
        llm.close()
    assert bool(calls) == one_call
    assert not one_call or any(calls)     # NOTE: the final norm and the head ran in the same call (the logits)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama3", "qwen2", "demo-llama", "mistral-sliding", "phi3"])
def test_one_call_step_equals_the_per_op_path(name, dtype, monkeypatch):
    """Also with every layer's window shorter than the prompts (Mistral, Phi-3: partial rotary)."""
    monkeypatch.setattr(kernels, "prefer_native", lambda x, weight: True)
    model = demo_checkpoint() if name == "demo-llama" else hf_checkpoint(name)
    assert generate(model, dtype, True, monkeypatch) == generate(model, dtype, False, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["gguf", "int8"])
def test_quantized_projections_in_the_one_call_step(scheme, dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(quant, "probe_quantized", lambda dense, packed, threads: ProbeResult(64, ()))
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(64, ()))
    monkeypatch.setattr(kernels, "prefer_native", lambda x, weight: True)    # the layers the GGUF keeps dense
    model = write_gguf_model(demo_checkpoint("qwen2"), tmp_path / "gguf") if scheme == "gguf" else hf_checkpoint("llama3")
    blocks = []
    module, name = (gguf_modules, "gguf_linear_native") if scheme == "gguf" else (quant, "quant_linear_native")
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: blocks.append(a[0].shape[0]) or real(*a))
    ours = generate(model, dtype, True, monkeypatch, quantization=scheme)
    assert blocks and max(blocks) > 1                        # prefill chunks still run the per-op blocks
    assert ours == generate(model, dtype, False, monkeypatch, quantization=scheme)


def test_disaggregated_decode_takes_the_one_call_step(monkeypatch):
    monkeypatch.setattr(kernels, "prefer_native", lambda x, weight: True)
    ours = generate(hf_checkpoint("llama3"), "float32", True, monkeypatch, mode="disaggregated")
    reference = generate(hf_checkpoint("llama3"), "float32", False, monkeypatch, mode="disaggregated")
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(ours, reference):
        assert tokens == expected_tokens          # NOTE: hand-off timing varies the batches, so the rounding
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=0)


def cpu_model(name: str):
    return load_model(ModelConfig.from_dir(hf_checkpoint(name)), torch.float32, torch.device("cpu"), 256)


def test_models_it_cannot_serve_keep_the_per_op_path(monkeypatch):
    monkeypatch.setattr(DecodeLayers, "serves", lambda self, rows: True)
    h = torch.randn(2, cpu_model("llama3").config.hidden_size)
    assert cpu_model("qwen3").native_decode_layers(h) is None          # q/k norms
    for name in ("gemma2", "gemma3", "smollm3"):      # soft-caps, norms, GeGLU; per-layer windows and rotary
        assert cpu_model(name).native_decode_layers(torch.randn(2, 64)) is None
    model = cpu_model("llama3")
    assert model.native_decode_layers(h) is not None
    assert model.native_decode_layers(h.bfloat16()) is None           # another dtype than the weights'
    monkeypatch.setattr(kernels, "use_native", lambda x: False)
    assert model.native_decode_layers(h) is None                       # --cpu-kernels torch


def test_replaced_weights_rebuild_the_table(monkeypatch):
    monkeypatch.setattr(DecodeLayers, "serves", lambda self, rows: True)
    model = cpu_model("llama3")
    h = torch.randn(1, model.config.hidden_size)
    first = model.native_decode_layers(h)
    assert model.native_decode_layers(h) is first
    qkv = model.layers[0].self_attn.qkv_proj
    qkv.weight.data = qkv.weight.data.clone()                         # moved: the old address is stale
    assert model.native_decode_layers(h) is not first
    assert model.native_decode_layers(h).layers[0].qkv.weight.data_ptr() == qkv.weight.data_ptr()
    quant._swap(model, "layers.1.mlp.down_proj", torch.nn.Identity())  # as quantization swaps one in
    assert model.native_decode_layers(h) is None                       # not a dense Linear: per-op path


def test_the_step_goes_native_where_every_projection_prefers_the_native_linear(monkeypatch):
    model = cpu_model("llama3")
    layers = model._build_decode_layers()
    gate_up_rows = 2 * model.config.intermediate_size
    asked = []

    def prefer(x, weight):
        asked.append(x.shape[0])
        return weight.shape[0] != gate_up_rows

    monkeypatch.setattr("pdserve.kernels.native_decode_layers.prefer_native", prefer)
    assert not layers.serves(0) and not layers.serves(65)              # above the native linear's rows
    assert not layers.serves(3)                                        # gate-up prefers BLAS at 3 rows
    assert set(asked) == {3}
    before = len(asked)
    assert not layers.serves(3) and len(asked) == before               # remembered per row count
    monkeypatch.setattr("pdserve.kernels.native_decode_layers.prefer_native", lambda x, weight: True)
    assert layers.serves(5)                                            # another row count: asked afresh


def test_the_pointer_table_has_the_layout_the_native_step_reads(monkeypatch):
    from pdserve.kernels.native_decode_layers import WORDS_PER_LAYER

    model = cpu_model("qwen2")                                            # q/k/v bias: non-null words
    layers = model._build_decode_layers()
    table = layers.table(1).view(len(model.layers), WORDS_PER_LAYER)
    first = model.layers[0]
    assert table[0, 0] == first.input_norm.weight.data_ptr()
    assert table[0, 1] == first.pre_mlp_norm.weight.data_ptr()
    assert table[0, 2:8].tolist() == [0, first.self_attn.qkv_proj.weight.data_ptr(),
                                      first.self_attn.qkv_proj.bias.data_ptr(), 0, 0, 0]
    assert table[-1, -6:].tolist() == [0, model.layers[-1].mlp.down_proj.weight.data_ptr(), 0, 0, 0, 0]


def quantized_cpu_model(monkeypatch, max_rows: int):
    monkeypatch.setattr(quant, "probe_quantized", lambda dense, packed, threads: ProbeResult(max_rows, ()))
    model = cpu_model("llama3")
    quant.quantize_model(model, "int8", None, threads=1)
    return model


def test_quantized_projections_read_their_dense_weights_above_their_rows(monkeypatch):
    from pdserve.kernels.native_decode_layers import WORDS_PER_LAYER

    native = {"dense": True}
    monkeypatch.setattr("pdserve.kernels.native_decode_layers.prefer_native", lambda x, weight: native["dense"])
    model = quantized_cpu_model(monkeypatch, max_rows=2)
    layers = model._build_decode_layers()
    qkv = model.layers[0].self_attn.qkv_proj
    blocks = layers.table(2).view(len(model.layers), WORDS_PER_LAYER)
    assert blocks[0, 2] != 0 and blocks[0, 3] == qkv.packed.qs.data_ptr()        # up to max_rows: the blocks
    dense = layers.table(3).view(len(model.layers), WORDS_PER_LAYER)
    assert dense[0, 2:4].tolist() == [0, qkv.weight.data_ptr()]                  # above: the dense weight
    assert layers.table(3) is layers.table(4)                                   # one table per choice
    assert layers.serves(2) and layers.serves(3)
    native["dense"] = False                                                     # BLAS wins the dense weight:
    fresh = model._build_decode_layers()
    assert fresh.serves(2) and not fresh.serves(3)                              # above max_rows, per-op path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_past_the_blocks_rows_in_one_call_equals_the_per_op_path(dtype, monkeypatch):
    monkeypatch.setattr(quant, "probe_quantized", lambda dense, packed, threads: ProbeResult(1, ()))
    monkeypatch.setattr(kernels, "prefer_native", lambda x, weight: True)
    tables = []
    real = DecodeLayers.table
    monkeypatch.setattr(DecodeLayers, "table", lambda self, rows: tables.append(rows) or real(self, rows))
    model = hf_checkpoint("llama3")
    ours = generate(model, dtype, True, monkeypatch, quantization="int8")
    assert 1 in tables and max(tables) > 1                     # both the blocks' and the dense weights' table
    assert ours == generate(model, dtype, False, monkeypatch, quantization="int8")


@pytest.mark.parametrize("one_call_faster", [True, False])
def test_the_decode_step_path_is_the_faster_whole_step_timed_at_load(one_call_faster, monkeypatch):
    from pdserve.engine.worker.model_runner import ModelRunner
    from pdserve.engine.worker.startup import warmup
    from pdserve.kernels.native_linear import row_buckets

    runner = ModelRunner(cpu_model("llama3"), 64, 16, frozenset())
    layers = runner.model.one_call_layers()
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: pytest.fail("timed steps are stubbed here"))
    steps = []

    def timed(runner_, step):
        rows, threads = len(step.decode_rows), torch.get_num_threads()
        one_call = layers._timed[(rows, threads)]
        steps.append((rows, threads, one_call))
        return 1.0 if one_call == one_call_faster else 2.0

    monkeypatch.setattr(warmup, "_timed_synthetic", timed)
    monkeypatch.setattr(warmup, "run_synthetic", lambda runner_, step: None)
    assert warmup.time_one_call_steps(runner, (1, 2)) == 2 * len([b for b in row_buckets() if b <= 8])
    assert {(rows, one_call) for rows, _, one_call in steps} == {(b, c) for b in (1, 2, 4, 8) for c in (True, False)}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert all(layers.serves(rows) == one_call_faster for rows in range(1, 9))  # a bucket covers its rows
    finally:
        torch.set_num_threads(previous)
