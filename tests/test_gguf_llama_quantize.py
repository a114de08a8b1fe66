"""Files made by llama.cpp's own llama-quantize (Q4_K_M, Q5_K_M, Q6_K, Q8_0 of a tiny Llama: mixed types per
tensor, a q/k/v of Q4_K + Q6_K) computed from their blocks, against transformers' own GGUF loader.

transformers dequantizes; pdserve's kernels quantize each projection's input per block as llama.cpp does,
so the comparison allows the divergence that rounding causes and no more (tests/quant_reference.py: the
bound is how far the same rounding moves transformers' own float64 logits). The files and the script that
made them: tests/fixtures/gguf/quantized, experiments/llama_quantize_fixtures.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model import quant_gguf
from pdserve.engine.model.gguf import converted_dir
from pdserve.engine.model.gguf_modules import GGUFLinear
from pdserve.engine.model.quant_probe import ProbeResult
from pdserve.kernels.gguf_linear import native_available
from tests.gguf_models import model_logits
from tests.models import engine_config
from tests.quant_reference import Reference, gguf_types

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler for the native kernels")
FIXTURES = Path(__file__).parent / "fixtures" / "gguf" / "quantized"
FILES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
PROMPTS = [torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 19, 45)]


@pytest.fixture(autouse=True)
def blocks_for_every_batch(monkeypatch, tmp_path):
    """Every step computes from the blocks (the probe would send large prefill steps to exact tiles)."""
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(256, ()))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))


def reference(kind: str) -> Reference:
    path = FIXTURES / f"tiny-{kind}.gguf"
    models = [transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
              for dtype in (torch.float32, torch.float64)]
    return Reference(*models, gguf_types(path))


@pytest.mark.parametrize("kind", FILES)
def test_logits_within_the_activation_rounding_of_transformers(kind):
    ref = reference(kind)
    for prompt, ours in zip(PROMPTS, model_logits(converted_dir(FIXTURES / f"tiny-{kind}.gguf"), PROMPTS, "gguf")):
        ref.assert_logits_close(ours, prompt)


@pytest.mark.parametrize("kind", FILES)
def test_greedy_tokens_agree_with_transformers_where_the_margin_decides(kind):
    llm = LLM(config=engine_config(FIXTURES / f"tiny-{kind}.gguf", quantization="gguf", max_prefill_tokens=16))
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0))
    finally:
        llm.close()
    ref = reference(kind)
    decided = sum(ref.assert_generation_close(output, prompt) for prompt, output in zip(PROMPTS, outputs))
    assert decided >= len(PROMPTS) * 16 * 3 // 4, f"only {decided} steps had a margin above the bound"


def test_the_fixtures_mix_types_within_a_fused_projection():
    types = gguf_types(FIXTURES / "tiny-Q4_K_M.gguf")
    assert {types[f"blk.1.attn_{p}.weight"] for p in "qkv"} == {"Q4_K", "Q6_K"}
    assert types["token_embd.weight"] == "Q6_K"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", FILES)
def test_on_cuda_the_blocks_go_through_the_triton_kernels(kind):
    """The same files on a GPU: the blocks copied there, dequantized as they are multiplied (no activation
    rounding, so well inside the bound)."""
    llm = LLM(config=engine_config(FIXTURES / f"tiny-{kind}.gguf", quantization="gguf", mode="colocated"))
    try:
        model = llm.engine.actors[-1].runner.model
        held = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        assert held and all(s.data.is_cuda for m in held for s in m.matrix.segments)
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0))
    finally:
        llm.close()
    ref = reference(kind)
    for prompt, output in zip(PROMPTS, outputs):
        ref.assert_generation_close(output, prompt)
