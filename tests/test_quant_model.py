"""Whole models with quantized projections against the same models loaded with the dequantized weights
(where the blocks land and what the loader skips: tests/test_gguf_blocks.py).

The GGUF files are written here with gguf.GGUFWriter from the tiny checkpoints, q/k rows permuted as
llama.cpp's converter does; the dequantized references are gguf.quants.dequantize un-permuted by
transformers' own GGUF loader code. Every test runs in float32. int8: the kernel differs from the dense
path only in the order of fp32 sums, so greedy tokens are equal and log-probs within 1e-4. GGUF blocks:
the kernels quantize each projection's input per block (as llama.cpp does), so they are held to the
divergence that rounding causes in transformers' own logits on the dequantized weights
(tests/quant_reference.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve import kernels
from pdserve.engine.config import ModelConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model import gguf_modules, quant, quant_gguf, quant_probe
from pdserve.engine.model.gguf import converted_dir
from pdserve.engine.model.gguf_modules import GGUFLinear
from pdserve.engine.model.quant import QuantizedLinear, quantize_model
from pdserve.engine.model.quant_probe import ProbeResult
from pdserve.engine.worker.model_runner import load_model
from pdserve.kernels import native
from pdserve.kernels.quant_formats import dequantize, quantize_int8
from pdserve.kernels.quant_linear import kernel_layout, native_available
from tests.gguf_models import model_logits
from tests.models import demo_checkpoint, engine_config, hf_checkpoint
from tests.quant_reference import Reference, gguf_types

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler for the native kernel")

CHECKPOINTS = {"demo-llama": lambda: demo_checkpoint("llama"),           # untied head, permuted q/k
               "demo-qwen2": lambda: demo_checkpoint("qwen2"),           # tied head, q/k/v bias
               "hf-llama3": lambda: hf_checkpoint("llama3")}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
LAYER_TYPES = [  # per layer: q, k, v, o, gate, up, down (an F32 projection stays dense; a mixed one is fused)
    ("Q4_1", "Q4_1", "Q5_0", "Q8_0", "Q4_0", "Q4_0", "Q4_1"),
    ("Q8_0", "Q8_0", "Q8_0", "F32", "Q4_1", "Q8_0", "Q5_1"),
]


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def copy_with_weights(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q_proj / k_proj rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def transformers_unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(weight, heads, heads)


def gguf_entries(src: Path) -> list[tuple[str, str, str, int]]:
    """(HF name, GGUF name, type, heads to permute by or 0) for every projection of the checkpoint."""
    config = ModelConfig.from_dir(src)
    permute = config.architecture == "llama"
    entries = []
    for i, types in enumerate(LAYER_TYPES[:config.num_layers]):
        for (hf, short), kind in zip(GGUF_NAMES.items(), types):
            heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(short, 0) if permute else 0
            entries.append((f"model.layers.{i}.{hf}.weight", f"blk.{i}.{short}.weight", kind, heads))
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    entries.append((head, "token_embd.weight" if config.tie_word_embeddings else "output.weight", "Q8_0", 0))
    return entries


def write_gguf_model(src: Path, out: Path) -> Path:
    """A copy of `src` at `out` whose projections are the dequantized blocks of `out/model.gguf`."""
    tensors, staged = read_tensors(src), out.with_suffix(".gguf")
    writer = gguf.GGUFWriter(str(staged), ModelConfig.from_dir(src).architecture.replace("mistral", "llama"))
    for hf, name, kind, heads in gguf_entries(src):
        weight = tensors[hf].numpy()
        qtype = gguf.GGMLQuantizationType[kind]
        raw = gguf.quants.quantize(llama_cpp_permute(weight, heads) if heads else weight, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        dense = gguf.quants.dequantize(raw, qtype)
        tensors[hf] = torch.from_numpy(transformers_unpermute(dense, heads) if heads else dense)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    copy_with_weights(src, out, tensors)
    shutil.move(staged, out / "model.gguf")
    return out


def write_int8_model(src: Path, dst: Path) -> Path:
    """A copy of `src` whose projections (and a tied head's embedding) are dequantized int8."""
    tensors = read_tensors(src)
    head = "model.embed_tokens.weight" if ModelConfig.from_dir(src).tie_word_embeddings else "lm_head.weight"
    for name, tensor in tensors.items():
        if any(p in name for p in GGUF_NAMES) and name.endswith(".weight") or name == head:
            tensors[name] = dequantize(quantize_int8(tensor))
    return copy_with_weights(src, dst, tensors)


@pytest.fixture
def kernel_for_every_batch(monkeypatch):
    """The probes' decisions made here: every batch up to 64 rows takes the quantized (block) kernel."""
    monkeypatch.setattr(quant, "probe_quantized", lambda dense, packed, threads: ProbeResult(64, ()))
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(64, ()))


PROMPTS = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 40)]


def greedy(model_dir: Path, quantization: str, **config) -> list:
    llm = LLM(config=engine_config(model_dir, quantization=quantization, max_prefill_tokens=16, **config))
    prompts = PROMPTS
    try:
        return llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0))
    finally:
        llm.close()


def reference_of(model_dir: Path) -> Reference:
    """transformers on the directory's (dequantized) weights, with its GGUF's types (tests/quant_reference.py)."""
    import transformers

    return Reference(*(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
                       for dtype in (torch.float32, torch.float64)), gguf_types(model_dir / "model.gguf"))


def assert_close_to_reference(outputs: list, model_dir: Path) -> None:
    """GGUF generations within the activation quantization's divergence of the dequantized model."""
    reference = reference_of(model_dir)
    for prompt, output in zip(PROMPTS, outputs):
        reference.assert_generation_close(output, prompt)


def assert_same_generations(ours: list, expected: list) -> None:
    for a, b in zip(ours, expected):
        assert list(a.token_ids) == list(b.token_ids)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_gguf_model_computes_as_its_dequantized_weights_with_quantized_activations(name, tmp_path,
                                                                                    kernel_for_every_batch):
    model_dir = write_gguf_model(CHECKPOINTS[name](), tmp_path / "gguf")
    reference = reference_of(model_dir)
    for prompt, ours in zip(PROMPTS, model_logits(model_dir, PROMPTS, quantization="gguf")):
        reference.assert_logits_close(ours, prompt)


@pytest.mark.parametrize("name", ["demo-llama", "hf-llama3"])
def test_int8_model_generates_as_its_dequantized_weights(name, tmp_path, kernel_for_every_batch):
    src = CHECKPOINTS[name]()
    assert_same_generations(greedy(src, "int8"), greedy(write_int8_model(src, tmp_path / "int8"), "none"))


def counted(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("mode", ["adaptive", "colocated", "disaggregated"])
def test_native_cpu_kernels_compose_with_gguf_blocks(mode, tmp_path, monkeypatch, kernel_for_every_batch):
    """gguf blocks with the native attention/norm/rotary/SiLU kernels generate what they do with the torch
    references (the same block kernels either way), and dense weights through the native GEMV what the
    dense model with the torch references does."""
    if native.cpu_kernels() is None:
        pytest.skip("no C++ compiler for the native CPU kernels")
    model_dir = write_gguf_model(CHECKPOINTS["demo-llama"](), tmp_path / "gguf")
    blocks = counted(monkeypatch, gguf_modules, "gguf_linear_native")
    attention = counted(monkeypatch, kernels, "decode_attention_native")
    for cpu_kernels in ("torch", "native"):
        assert_close_to_reference(greedy(model_dir, "gguf", cpu_kernels=cpu_kernels, mode=mode), model_dir)
    assert blocks and attention
    expected = greedy(model_dir, "none", cpu_kernels="torch", mode=mode)
    gemv = counted(monkeypatch, kernels, "linear_native")
    monkeypatch.setattr(kernels, "prefer_native", lambda x, w: x.shape[0] <= 64)    # NOTE: not timing-dependent
    assert_same_generations(greedy(model_dir, "none", cpu_kernels="native", mode=mode), expected)
    assert gemv


def test_quantized_linear_takes_the_kernel_only_up_to_max_rows():
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(64, 96, generator=generator)
    packed = quantize_int8(torch.randn(64, 96, generator=generator))    # NOTE: other weights on purpose
    layer = QuantizedLinear(torch.nn.Parameter(dense, requires_grad=False), None, kernel_layout(packed), max_rows=4)
    small, large = torch.randn(4, 96, generator=generator), torch.randn(5, 96, generator=generator)
    torch.testing.assert_close(layer(small), small @ dequantize(packed).T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(large), large @ dense.T, atol=1e-5, rtol=1e-5)  # NOTE: BLAS or native GEMV


def tiny_model(dtype=torch.float32):
    return load_model(ModelConfig.from_dir(demo_checkpoint("llama")), dtype, torch.device("cpu"), 64)


def test_decisions_without_a_win_or_a_source_keep_the_model_dense(tmp_path, monkeypatch):
    model = tiny_model()
    assert quantize_model(model, "none", None, 1).scheme == "none"
    assert "no GGUF file" in quantize_model(model, "auto", None, 1).reason
    assert "bfloat16" in quantize_model(tiny_model(torch.float16), "int8", None, 1).reason
    with pytest.raises(ValueError, match="needs the model's GGUF file"):
        quantize_model(model, "gguf", None, 1)
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(0, ((1, 1.0, 2.0),)))
    gguf_dir = write_gguf_model(demo_checkpoint("llama"), tmp_path / "gguf")
    model = load_model(ModelConfig.from_dir(gguf_dir), torch.float32, torch.device("cpu"), 64)
    decision = quantize_model(model, "auto", gguf_dir / "model.gguf", 1)
    assert decision.scheme == "gguf" and decision.max_rows == 1     # tiles faster even at batch 1: blocks there
    assert all(m.max_rows == 1 for m in model.modules() if isinstance(m, GGUFLinear))


def test_probe_on_real_weights_returns_timings():
    model = tiny_model()
    weights = [model.layers[i].mlp.gate_up_proj.weight for i in range(2)]
    packed = [kernel_layout(quantize_int8(w)) for w in weights]
    result = quant.probe_quantized(weights, packed, threads=1, batch_sizes=(1, 2))
    assert result.timings and all(dense > 0 and q > 0 for _, dense, q in result.timings)
    assert result.max_rows in (0, 1, 2)


def test_the_probe_streams_twice_the_cpus_largest_cache_or_every_layer(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index4").mkdir()                                  # no size file: skipped
    assert quant_probe.last_level_cache_bytes(tmp_path) == 480 << 20
    assert quant_probe.probe_bytes(tmp_path) == 960 << 20
    assert quant_probe.probe_bytes(tmp_path / "absent") == quant_probe.MIN_PROBE_BYTES
    model = tiny_model()
    dense = quant.projections(model)
    names = list(dense)
    per = max(m.weight.numel() * 4 for n, m in dense.items() if n != "lm_head")
    layers = len(model.layers)
    assert len(quant._probe_names(names, dense, streamed=per)) == 1
    assert len(quant._probe_names(names, dense, streamed=2 * per)) == min(2, layers)
    assert len(quant._probe_names(names, dense, streamed=960 << 20)) == layers     # a big cache: every layer


def test_gguf_source_is_the_converted_file_or_the_one_in_the_directory(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "gguf_source.json").write_text(json.dumps({"gguf_file": str(gguf_file)}))
    assert quant.gguf_source(converted) == gguf_file
    assert quant.gguf_source(tmp_path) == gguf_file
    gguf_file.unlink()
    assert quant.gguf_source(converted) is None and quant.gguf_source(tmp_path) is None


def test_cli_option_reaches_the_engine_config():
    import argparse

    from pdserve.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).quantization == "auto"
    assert engine_config_from_args(parser.parse_args(["--quantization", "gguf"])).quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])


def test_the_block_probes_answer_is_kept_and_a_later_start_with_the_same_inputs_takes_it(monkeypatch):
    """A near tie at the crossover must not give one machine another kernel path at every start."""
    calls = []

    def probe(matrices, dtype, threads):
        calls.append(threads)
        return ProbeResult(len(calls) * 4, ())
    monkeypatch.setattr(quant_gguf, "probe_blocks", probe)
    config = ModelConfig.from_dir(converted_dir(Path(__file__).parent / "fixtures/gguf/quantized/tiny-Q8_0.gguf"))

    def max_rows(threads: int) -> int:
        model = load_model(config, torch.float32, torch.device("cpu"), 64, "gguf", threads)
        return next(m.max_rows for m in model.modules() if isinstance(m, GGUFLinear))
    assert (max_rows(2), max_rows(2), calls) == (4, 4, [2])
    assert (max_rows(1), calls) == (8, [2, 1])                          # other inputs: probed again
