"""Small GGUF files (Llama and Qwen2, tied and untied, many tensor types) against transformers'
own GGUF loader: the same weights, the same logits and greedy tokens, the same tokenizer."""
from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model import gguf as gguf_model
from pdserve.engine.model.gguf import converted_dir, find_gguf
from pdserve.engine.model.gguf_config import llama3_factors
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.model import quant_gguf
from pdserve.engine.model.quant_probe import ProbeResult
from tests.gguf_models import Q, make_transformers_model, model_logits, write_gguf
from tests.quant_reference import Reference, gguf_types
from tests.tolerance import assert_float32_close, reference_logits
from tests.models import engine_config

CASES = {
    "llama-untied": ("llama", False, "llama-bpe", True,
                     {"attn_q": Q.Q4_K, "attn_k": Q.Q8_0, "attn_v": Q.BF16, "attn_output": Q.F16,
                      "ffn_gate": Q.Q6_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1, "token_embd": Q.Q8_0,
                      "output.weight": Q.Q6_K}),
    "llama-tied": ("llama", True, "smollm", False, {"attn": Q.Q4_0, "ffn": Q.Q4_1, "token_embd": Q.Q8_0}),
    "qwen2-tied": ("qwen2", True, "qwen2", False, {"attn": Q.Q5_0, "ffn": Q.Q6_K, "token_embd": Q.Q4_K}),
    "qwen2-untied": ("qwen2", False, "qwen2", False, {"attn": Q.Q8_0, "ffn": Q.Q5_1, "output.weight": Q.Q8_0}),
}
TEXTS = ["Hello world 12345  foo\n\n  bar", "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x ** 2",
         "Größe ≈ 4.0 🚀 你好，世界！", "   \t  trailing   ", "a\r\nb 1 22 333 4444"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]
ROOT = Path(tempfile.mkdtemp(prefix="pdserve-gguf-tests-"))


@functools.cache
def gguf_file(case: str) -> Path:
    arch, tied, pre, add_bos, types = CASES[case]
    folder = ROOT / case
    folder.mkdir()
    return write_gguf(make_transformers_model(arch, tied), folder / f"{case}.Q.gguf", types, pre=pre,
                      add_bos=add_bos)


@functools.cache
def reference(case: str):
    path = gguf_file(case)
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PDSERVE_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
    yield
    patch.undo()


def random_prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=generator).tolist() for n in (5, 33, 70)]


@pytest.mark.parametrize("case", CASES)
def test_conversion_holds_exactly_the_weights_transformers_reads(case):
    ours = transformers.AutoModelForCausalLM.from_pretrained(converted_dir(gguf_file(case)), dtype=torch.float32)
    theirs = reference(case).state_dict()
    assert ours.config.tie_word_embeddings == CASES[case][1]
    assert ours.state_dict().keys() == theirs.keys()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.state_dict().items())


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case):
    model_dir = converted_dir(gguf_file(case))
    for prompt, ours in zip(random_prompts(0), model_logits(model_dir, random_prompts(0))):
        expected32, expected64 = reference_logits(reference(case), prompt)
        assert expected64.std() > 0.1
        assert_float32_close(ours, expected32, expected64)


@pytest.mark.parametrize("case", CASES)
def test_logits_from_the_blocks_within_the_activation_rounding_of_transformers(case, monkeypatch):
    """Computed from the blocks (a q/k/v of Q4_K + Q8_0 + BF16 parts among them): tests/quant_reference.py."""
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(256, ()))
    path = gguf_file(case)
    models = [transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
              for dtype in (torch.float32, torch.float64)]
    reference = Reference(*models, gguf_types(path))
    for prompt, ours in zip(random_prompts(0), model_logits(converted_dir(path), random_prompts(0), "gguf")):
        reference.assert_logits_close(ours, prompt)


@pytest.mark.parametrize("case", ["llama-untied", "qwen2-tied"])
def test_greedy_tokens_match_transformers(case):
    llm = LLM(config=engine_config(gguf_file(case), quantization="none"))   # NOTE: exact (tests/test_gguf_llama_quantize)
    try:
        outputs = llm.generate(random_prompts(1), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    for prompt, output in zip(random_prompts(1), outputs):
        expected = reference(case).generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                            do_sample=False, pad_token_id=0)[0, len(prompt):]
        assert list(output.token_ids) == expected.tolist()


@pytest.mark.parametrize("case", CASES)
def test_tokenizer_matches_transformers(case):
    path = gguf_file(case)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_dir(converted_dir(path))
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.add_bos == CASES[case][3]
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == rendered


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3's scaling as per-frequency factors; transformers' GGUF loader drops them, so
    the reference here is transformers on the original weights (the file is F32)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    model = make_transformers_model("llama", tied=False, rope_scaling=dict(scaling))
    freqs = 1.0 / 500000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64)
    path = write_gguf(model, tmp_path / "llama3.gguf", {}, pre="llama-bpe", rope_freqs=llama3_factors(scaling, freqs))
    model_dir = converted_dir(path)
    got = json.loads((model_dir / "config.json").read_text())["rope_scaling"]
    assert got == pytest.approx(scaling)
    prompts = [torch.randint(0, 1024, (600,), generator=torch.Generator().manual_seed(2)).tolist()]
    assert_float32_close(model_logits(model_dir, prompts)[0], *reference_logits(model.eval(), prompts[0]))


def test_conversion_is_cached_by_content_and_kept_on_a_second_start(tmp_path, monkeypatch):
    source = gguf_file("qwen2-tied")
    first = converted_dir(source)
    copy = Path(shutil.copy(source, tmp_path / "renamed-copy.gguf"))
    monkeypatch.setattr(gguf_model, "write_safetensors", lambda *a: pytest.fail("converted again"))
    assert converted_dir(source) == first == converted_dir(copy)        # same bytes, same directory
    record = json.loads((first / gguf_model.SOURCE_FILE).read_text())
    assert record["sha256"] == gguf_model.file_sha256(source) and Path(record["gguf_file"]) == source.resolve()
    assert record["tensors"]["model.layers.0.mlp.up_proj.weight"] == {
        "gguf_name": "blk.0.ffn_up.weight", "type": "Q6_K", "unpermute_heads": None}


def test_an_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    def interrupted(tensors, out_dir):
        next(tensors)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_model, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        converted_dir(gguf_file("llama-tied"))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_find_gguf(tmp_path):
    source = gguf_file("llama-tied")
    (tmp_path / "one").mkdir()
    shutil.copy(source, tmp_path / "one" / "m.gguf")
    blob = Path(shutil.copy(source, tmp_path / "sha256-0123abcd"))                  # Ollama's blob names
    assert find_gguf(str(source)) == source and find_gguf(str(tmp_path / "one")) == tmp_path / "one" / "m.gguf"
    assert find_gguf(str(blob)) == blob
    assert find_gguf(str(converted_dir(source))) is None                     # a Hugging Face directory
    assert find_gguf(str(tmp_path / "missing.bin")) is None
    shutil.copy(source, tmp_path / "one" / "n.gguf")
    with pytest.raises(gguf_model.GGUFError, match=r"holds 2 GGUF files \(m.gguf, n.gguf\)"):
        find_gguf(str(tmp_path / "one"))


def test_model_config_reads_the_converted_directory():
    config = ModelConfig.from_dir(converted_dir(gguf_file("qwen2-untied")))
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, False)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size) == (4, 2, 64, 256)
