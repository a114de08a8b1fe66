"""Bad checkpoints and prompts fail with one clear error naming the file, tensor or limit."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.model.weights import WeightError
from pdserve.engine.worker.model_runner import load_model
from tests.models import demo_checkpoint, engine_config


@pytest.fixture
def checkpoint(tmp_path):
    out = tmp_path / "model"
    shutil.copytree(demo_checkpoint(), out)
    return out


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json: file not found"):
        ModelConfig.from_dir(checkpoint)


def test_malformed_config(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: malformed JSON"):
        ModelConfig.from_dir(checkpoint)


def test_missing_key(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["hidden_size"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="missing required key 'hidden_size'"):
        ModelConfig.from_dir(checkpoint)


def test_unsupported_architecture(checkpoint):
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        ModelConfig.from_dir(checkpoint)


def test_new_and_old_rope_spellings_agree(checkpoint):
    old = ModelConfig.from_dir(checkpoint).rope
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(checkpoint).rope == old


def rewrite_weights(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    config = ModelConfig.from_dir(checkpoint)
    with pytest.raises(WeightError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(config, torch.float32, torch.device("cpu"), 128)


def test_wrong_shape(checkpoint):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]
    rewrite_weights(checkpoint, shrink)
    config = ModelConfig.from_dir(checkpoint)
    with pytest.raises(WeightError, match=r"model.safetensors: tensor model.layers.0.self_attn.k_proj.weight "
                                          r"has shape \(63, 128\), expected \(64, 128\)"):
        load_model(config, torch.float32, torch.device("cpu"), 128)


def test_sharded_checkpoint_loads_like_single_file(checkpoint, tmp_path):
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, checkpoint / file)
    (checkpoint / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(ModelConfig.from_dir(checkpoint), torch.float32, torch.device("cpu"), 128)
    reference = load_model(ModelConfig.from_dir(demo_checkpoint()), torch.float32, torch.device("cpu"), 128)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(ours, theirs), name


async def test_prompt_longer_than_context_window():
    engine = Engine(engine_config(demo_checkpoint(), max_model_len=64))
    await engine.start()
    try:
        with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, you requested 68 tokens"):
            engine.submit(Request("long", tuple(range(3, 63)), SamplingParams(max_tokens=8)))
        with pytest.raises(ValueError, match="prompt token ids must be in"):
            engine.submit(Request("bad-id", (5, 99999), SamplingParams(max_tokens=8)))
        assert engine.stats().num_unfinished == 0
    finally:
        await engine.stop()
        engine.close()
