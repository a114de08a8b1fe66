"""Qwen3.5 and Gemma 3 and 4 as published (`...ForConditionalGeneration`: a vision tower (Gemma 4: and an audio one)
beside the language model,
config under text_config, tensors under model.language_model.; Qwen's multi-token prediction head too) load
as their text model and give transformers' greedy tokens on text."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.text_of_multimodal import text_name
from tests.hf_models import transformers_config, transformers_greedy
from tests.models import demo_checkpoint, engine_config, hf_checkpoint
from tests.test_engine_modes import prompts

VISION = {
    "qwen3.5": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
    "gemma3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14),
    "gemma4": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16),
}
AUDIO = {"gemma4": dict(audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          subsampling_conv_channels=[8, 4], output_proj_dims=32))}
WRAPPERS = {"qwen3.5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
            "gemma3": (transformers.Gemma3Config, transformers.Gemma3ForConditionalGeneration),
            "gemma4": (transformers.Gemma4Config, transformers.Gemma4ForConditionalGeneration)}


@functools.cache
def multimodal_checkpoint(arch: str) -> Path:
    """A random tiny `arch` with its vision tower, saved by transformers (plus an `mtp.` tensor for Qwen)."""
    text, _ = transformers_config(arch)
    config_class, model_class = WRAPPERS[arch]
    extra = dict(mm_tokens_per_image=1) if arch == "gemma3" else {}
    config = config_class(text_config=text.to_dict(), vision_config=VISION[arch], **extra, **AUDIO.get(arch, {}))
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32).eval()
    out = hf_checkpoint(arch).parent / f"multimodal-{arch}"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((demo_checkpoint() / name).read_bytes())
    if arch == "qwen3.5":
        tensors = load_file(out / "model.safetensors")
        save_file({**tensors, "mtp.fc.weight": torch.zeros(4, 4)}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_names_of_a_multimodal_checkpoint_map_to_the_text_models():
    assert text_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_name("language_model.model.norm.weight") == "model.norm.weight"
    assert text_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_name("lm_head.weight") == "lm_head.weight"
    for unread in ("model.visual.blocks.0.attn.proj.weight", "vision_tower.encoder.x", "mtp.fc.weight",
                   "model.multi_modal_projector.mm_input_projection_weight", "model.audio_tower.layers.0.x",
                   "model.embed_audio.embedding_projection.weight", "model.embed_vision.embedding_projection.weight"):
        assert text_name(unread) is None


@pytest.mark.parametrize("arch", ["qwen3.5", "gemma3", "gemma4"])
def test_a_published_multimodal_checkpoint_serves_its_text_model_with_transformers_tokens(arch):
    path = multimodal_checkpoint(arch)
    config = ModelConfig.from_dir(path)
    assert config.architecture == {"qwen3.5": "qwen3_5", "gemma3": "gemma3", "gemma4": "gemma4"}[arch]
    reference = WRAPPERS[arch][1].from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts([9, 70], seed=31)
    llm = LLM(config=engine_config(path, mode="colocated", max_prefill_tokens=32))
    try:
        outputs = llm.generate([list(p) for p in batch],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    assert [list(out.token_ids) for out in outputs] == [transformers_greedy(reference, p, 12) for p in batch]
