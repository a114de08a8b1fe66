"""Each family's layer kinds as transformers reads them (windows, rotary per layer, old and new config
spellings), the context a sliding window leaves alone, and gpt-oss: its attention (sinks, alternating
windows, YaRN) against transformers' own layer; the expert layers of each mixture-of-experts family."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers

from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model.attention import Attention
from pdserve.engine.model.config import parse_config
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.rope import cos_sin_table
from pdserve.kernels.kv_layout import KVLayout
from tests.hf_models import ARCHS, COMMON, MOE_ARCHS, WINDOW, transformers_config
from tests.models import engine_config, hf_checkpoint
from tests.tolerance import assert_float32_close

SLIDING = "sliding_attention"


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_each_layers_window_is_the_one_transformers_gives_it(arch):
    hf, _ = transformers_config(arch)
    config = ModelConfig.from_dir(hf_checkpoint(arch))
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None) or [SLIDING if window else "full"] * len(config.layer_kinds)
    if arch in ("mistral-sliding", "phi3", "mixtral"):       # every layer slides (their attention reads no types)
        types = [SLIDING] * len(config.layer_kinds)
    assert config.windows == tuple(window if t == SLIDING and window else 0 for t in types)


def test_windows_of_every_sliding_family():
    assert ModelConfig.from_dir(hf_checkpoint("mistral-sliding")).windows == (WINDOW, WINDOW)
    assert ModelConfig.from_dir(hf_checkpoint("gemma2")).windows == (WINDOW, 0)
    assert ModelConfig.from_dir(hf_checkpoint("gemma3")).windows == (WINDOW, WINDOW, 0)
    smollm3 = ModelConfig.from_dir(hf_checkpoint("smollm3"))
    assert smollm3.windows == (0, 0, 0, WINDOW) and [k.rope is None for k in smollm3.layer_kinds] == [0, 0, 0, 1]


def rewritten(tmp_path, arch: str, **changes) -> ModelConfig:
    out = tmp_path / arch
    shutil.copytree(hf_checkpoint(arch), out)
    raw = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(out)


def test_old_config_spellings_read_as_the_new(tmp_path):
    gemma3 = ModelConfig.from_dir(hf_checkpoint("gemma3"))
    old = rewritten(tmp_path, "gemma3", layer_types=None, rope_parameters=None, sliding_window_pattern=3,
                    rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert old.layer_kinds == gemma3.layer_kinds
    assert gemma3.layer_kinds[0].rope.theta == 10000.0 and gemma3.layer_kinds[2].rope.factor == 8.0
    phi3 = ModelConfig.from_dir(hf_checkpoint("phi3"))
    rope = json.loads((hf_checkpoint("phi3") / "config.json").read_text())["rope_parameters"]
    old = rewritten(tmp_path, "phi3", rope_parameters=None, rope_theta=rope["rope_theta"],
                    rope_scaling={"type": "longrope", "short_factor": rope["short_factor"],
                                  "long_factor": rope["long_factor"]})
    assert old.layer_kinds == phi3.layer_kinds and old.rope.rope_type == "longrope"


def test_qwen_slides_only_with_use_sliding_window(tmp_path):
    assert rewritten(tmp_path, "qwen2", sliding_window=16).windows == (0, 0)
    windows = rewritten(tmp_path / "on", "qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1,
                        layer_types=None).windows
    assert windows == (0, 16)


def test_a_sliding_window_does_not_cap_the_context():
    engine = Engine(engine_config(hf_checkpoint("mistral-sliding"), max_model_len=None, mode="colocated"))
    try:
        assert engine.max_model_len == ModelConfig.from_dir(hf_checkpoint("mistral-sliding")).max_position_embeddings
        assert engine.max_model_len == 2048 > WINDOW
    finally:
        engine.close()


def gpt_oss_checkpoint(tmp_path):
    config = transformers.GptOssConfig(**{**COMMON, "num_hidden_layers": 2}, head_dim=16, sliding_window=WINDOW,
                                       num_local_experts=4, num_experts_per_tok=2,
                                       rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                        "original_max_position_embeddings": 256})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(tmp_path / "gpt-oss")
    return model, tmp_path / "gpt-oss"


def test_gpt_oss_is_served_with_its_experts(tmp_path):
    _, path = gpt_oss_checkpoint(tmp_path)
    config = ModelConfig.from_dir(path)
    assert all(kind.experts for kind in config.layer_kinds)
    assert (config.experts.num_experts, config.experts.top_k, config.experts.routing) == (4, 2, "topk_softmax")


def test_mxfp4_gpt_oss_is_refused_naming_what_to_serve_instead(tmp_path):
    with pytest.raises(ConfigError, match=r"quant_method 'mxfp4': gpt-oss's quantized expert blocks are not read; "
                                          r"serve a bfloat16 copy"):
        rewritten(tmp_path, "gpt-oss", quantization_config={"quant_method": "mxfp4"})


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_layers_and_routing_are_the_ones_transformers_builds(arch):
    """Which layers transformers gives a sparse MLP, and the routing numbers it reads."""
    hf, cls = transformers_config(arch)
    model = cls(hf)
    config = ModelConfig.from_dir(hf_checkpoint(arch))
    sparse = tuple(getattr(layer, "enable_moe_block", False) or not hasattr(layer.mlp, "down_proj")
                   for layer in model.model.layers)             # Gemma 4's experts sit beside a dense MLP
    assert tuple(kind.experts for kind in config.layer_kinds) == sparse and any(sparse)
    if arch == "gemma4-moe":
        router = model.model.layers[0].router
        assert (config.experts.num_experts, config.experts.top_k) == (router.proj.out_features, hf.top_k_experts)
        return
    router = next(layer.mlp for layer in model.model.layers if not hasattr(layer.mlp, "down_proj"))
    router = getattr(router, "gate", None) or router.router
    assert (config.experts.num_experts, config.experts.top_k) == (router.num_experts, router.top_k)
    assert config.experts.norm_topk_prob == getattr(router, "norm_topk_prob", True)


def attention_calls(model, prompt: list[int]) -> dict[int, dict]:
    """Each layer's attention call in transformers' forward: its keyword arguments (input, rotary, mask)."""
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(
            lambda module, args, kwargs, out, i=i: seen.__setitem__(i, dict(kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([prompt]), use_cache=False)
    return seen


def called(module, kwargs: dict, dtype: torch.dtype) -> torch.Tensor:
    """`module` (a copy, in `dtype`) called as transformers called it; its output [T, hidden]."""
    cast = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else
                tuple(x.to(dtype) for x in v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    with torch.no_grad():
        return copy.deepcopy(module).to(dtype)(**cast)[0][0]


def paged_attention(attention: Attention, config: ModelConfig, h: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Our layer over h [T, hidden], prefilled `chunks` tokens at a time (a chunk of 1: a decode step)."""
    block_size, tokens = 16, h.shape[0]
    pool = KVLayout(config.num_layers, block_size, config.num_kv_heads, config.head_dim).allocate(
        -(-tokens // block_size), torch.float32, "cpu")
    table = cos_sin_table(config.head_dim, 512, config.layer_kinds[attention.layer_index].rope)
    blocks = torch.arange(pool.shape[0], dtype=torch.int32)[None, :]
    outputs, done = [], 0
    for n in chunks:
        positions = torch.arange(done, done + n)
        batch = ForwardBatch(input_ids=positions, positions=positions, slot_mapping=positions, block_tables=blocks,
                             context_lens=torch.tensor([done + n], dtype=torch.int32),
                             cu_seqlens_q=None if n == 1 else torch.tensor([0, n], dtype=torch.int32),
                             logits_indices=torch.tensor([n - 1]))
        with torch.no_grad():
            outputs.append(attention(h[done:done + n], batch, pool, table))
        done += n
    return torch.cat(outputs)


def test_gpt_oss_attention_matches_transformers(tmp_path):
    """Sinks, a window shorter than the prompt on alternate layers, YaRN rotary: prefill in chunks and decode."""
    model, path = gpt_oss_checkpoint(tmp_path)
    config = parse_config(path, json.loads((path / "config.json").read_text()), path / "config.json")
    assert config.attention_sinks and config.windows == (WINDOW, 0) and config.rope.rope_type == "yarn"
    prompt = torch.randint(0, COMMON["vocab_size"], (90,), generator=torch.Generator().manual_seed(4)).tolist()
    for i, kwargs in attention_calls(model, prompt).items():
        theirs, ours = model.model.layers[i].self_attn, Attention(config, i)
        with torch.no_grad():
            ours.qkv_proj.weight.copy_(torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]))
            ours.qkv_proj.bias.copy_(torch.cat([theirs.q_proj.bias, theirs.k_proj.bias, theirs.v_proj.bias]))
            ours.o_proj.weight.copy_(theirs.o_proj.weight)
            ours.o_proj.bias.copy_(theirs.o_proj.bias)
            ours.sinks.copy_(theirs.sinks)
        out = paged_attention(ours, config, kwargs["hidden_states"][0], [40, 30, 1, 1, 18])
        assert_float32_close(out, called(theirs, kwargs, torch.float32), called(theirs, kwargs, torch.float64))
