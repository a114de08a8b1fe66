"""The built-in demo checkpoint, loaded by transformers."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pdserve.engine.model.demo import (
    SIZES,
    default_model_dir,
    make_model,
    model_config,
    num_parameters,
)
from pdserve.engine.model.demo_corpus import ENDOFTEXT, IM_END
from pdserve.engine.text.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_model(tmp_path_factory.mktemp("demo") / f"tiny-{arch}", "tiny", arch)


def _load(model_dir: Path):
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


def test_transformers_loads_every_weight(tiny):
    arch, model_dir = tiny
    model, info = _load(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert model.dtype == torch.float32
    config = json.loads((model_dir / "config.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    assert 300_000 < num_parameters(config) < 900_000
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == (arch == "llama")
    assert ("model.layers.1.self_attn.k_proj.bias" in names) == (arch == "qwen2")
    assert "model.layers.1.mlp.down_proj.weight" in names and "model.norm.weight" in names


def test_logits_finite_separated_and_context_dependent(tiny):
    _, model_dir = tiny
    model, _ = _load(model_dir)
    ids = torch.randint(3, 1024, (1, 4096))
    with torch.no_grad():
        logits = model(ids).logits[0]  # [4096, vocab]
        changed = ids.clone()
        changed[0, 0] = 4 if ids[0, 0] == 3 else 3
        logits_changed = model(changed[:, :64]).logits[0]
    assert torch.isfinite(logits).all()
    assert 2.0 < logits.std(-1).mean().item() < 4.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.2  # greedy decoding is not a coin toss
    assert (logits_changed[1:] - logits[1:64]).abs().max() > 0.5  # later positions attend to position 0


def test_config_and_generation_config(tiny):
    arch, model_dir = tiny
    config = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_dir(model_dir)
    eos = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == eos
    assert tok.eos_token_ids == set(eos) and tok.vocab_size == config["vocab_size"] == 1024
    assert config["hidden_size"] == 128 and config["num_hidden_layers"] == 2
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 4096 and config["torch_dtype"] == "float32"
    if arch == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
        assert config["head_dim"] == 32 and not config["tie_word_embeddings"]
    else:
        assert config["rope_theta"] == 1e6 and config["tie_word_embeddings"]


def test_norm_weights_near_one_but_not_ones(tiny):
    _, model_dir = tiny
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert not torch.equal(norm, torch.ones_like(norm))
    assert (norm - 1).abs().max() < 0.5


def test_same_seed_same_bytes_different_seed_differs(tmp_path):
    first = make_model(tmp_path / "a", "tiny", "qwen2", seed=7)
    second = make_model(tmp_path / "b", "tiny", "qwen2", seed=7)
    third = make_model(tmp_path / "c", "tiny", "qwen2", seed=8)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert (first / "model.safetensors").read_bytes() != (third / "model.safetensors").read_bytes()


def test_deterministic_across_processes(tmp_path):
    """Hash seeds differ between processes; the BPE training and the weights must not care."""
    code = f"from pdserve.engine.model.demo import make_model; make_model({str(tmp_path / 'x')!r}, 'tiny', 'llama')"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    here = make_model(tmp_path / "y", "tiny", "llama")
    for name in FILES:
        assert (tmp_path / "x" / name).read_bytes() == (here / name).read_bytes()


def test_base_size(tmp_path):
    assert 75e6 < num_parameters(model_config(SIZES["base"], "llama")) < 85e6
    assert 70e6 < num_parameters(model_config(SIZES["base"], "qwen2")) < 80e6
    model_dir = make_model(tmp_path / "base", "base", "llama")
    model, info = _load(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == num_parameters(json.loads((model_dir / "config.json").read_text()))
    assert Tokenizer.from_dir(model_dir).vocab_size == 8192
    with torch.no_grad():
        logits = model(torch.randint(3, 8192, (1, 256))).logits.float()
    assert torch.isfinite(logits).all() and 2.0 < logits.std(-1).mean().item() < 4.0


def test_default_model_dir_generates_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    first = default_model_dir("tiny", "qwen2")
    assert first == tmp_path / "demo-tiny-qwen2-s0"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("tiny", "qwen2") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny-qwen2-s0"]


def test_default_model_dir_concurrent_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    results, start = [], threading.Barrier(3)

    def call() -> None:
        start.wait()
        results.append(default_model_dir("tiny", "llama"))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "demo-tiny-llama-s0"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny-llama-s0"]
    expected = make_model(tmp_path / "ref", "tiny", "llama")
    for name in FILES:
        assert (results[0] / name).read_bytes() == (expected / name).read_bytes()


def test_unknown_size_or_arch(tmp_path):
    with pytest.raises(ValueError, match="huge"):
        make_model(tmp_path, "huge")
    with pytest.raises(ValueError, match="gpt2"):
        make_model(tmp_path, "tiny", "gpt2")
