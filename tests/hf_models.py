"""Tiny checkpoints written by transformers itself, for parity tests (no hub access)."""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama3", "qwen2", "qwen3", "llama-head24", "mistral-sliding", "gemma2", "gemma3", "gemma4", "phi3",
         "smollm3")
MOE_ARCHS = ("mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss", "gemma4-moe")
HYBRID_ARCHS = ("qwen3-next", "qwen3.5", "qwen3.5-moe")
EXPERTS = dict(num_experts_per_tok=2)        # of 8: routing decides which weights a token reads
LONGROPE_ORIGINAL = 64     # "phi3-longrope": prompts past this take LongRoPE's long factors in transformers too
COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.08,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 32      # sliding windows shorter than the test prompts (and than one prefill chunk of them)


def transformers_config(arch: str):
    """(config, model class) of `arch`, from transformers' own config classes."""
    import transformers

    if arch == "llama3":
        return transformers.LlamaConfig(
            **COMMON, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}), \
            transformers.LlamaForCausalLM
    if arch == "llama-head24":                       # a head size the native attention kernels do not take
        return transformers.LlamaConfig(**{**COMMON, "hidden_size": 96}, head_dim=24), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=True), \
            transformers.Qwen2ForCausalLM
    if arch == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=32, rope_theta=1e6, tie_word_embeddings=False), \
            transformers.Qwen3ForCausalLM
    if arch == "mistral-sliding":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW), transformers.MistralForCausalLM
    if arch == "gemma2":                             # alternating sliding and full layers, both soft-caps
        return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=5.0), \
            transformers.Gemma2ForCausalLM
    if arch == "gemma3":                             # local and global layers with their own rotary bases
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}), \
            transformers.Gemma3ForCausalLM
    if arch == "gemma4":
        return gemma4_config(), transformers.Gemma4ForCausalLM
    if arch in ("phi3", "phi3-longrope"):            # fused projections, partial rotary, LongRoPE (short / long)
        original = 2048 if arch == "phi3" else LONGROPE_ORIGINAL
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.9, 2.8],
                "long_factor": [1.5, 4.0, 9.0, 20.0], "original_max_position_embeddings": original}
        return transformers.Phi3Config(**{**COMMON, "max_position_embeddings": 4096}, partial_rotary_factor=0.5,
                                       original_max_position_embeddings=original, rope_parameters=rope,
                                       sliding_window=WINDOW if arch == "phi3" else None), \
            transformers.Phi3ForCausalLM
    if arch == "smollm3":                            # every fourth layer without rotary embedding, and sliding
        return transformers.SmolLM3Config(**{**COMMON, "num_hidden_layers": 4}, use_sliding_window=True,
                                          sliding_window=WINDOW), transformers.SmolLM3ForCausalLM
    if arch in HYBRID_ARCHS:
        return hybrid_config(arch)
    return moe_config(arch)


def gemma4_config():
    """Gemma 4 with every text feature at once: full layers with twice the head size, keys as values and one KV
    head; proportional RoPE; the last two layers (a sliding and a full one) reading earlier layers' K and V with
    MLPs twice as wide; per-layer inputs; capped logits."""
    import transformers

    return transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=WINDOW, layer_types=GEMMA4_LAYERS, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=COMMON["vocab_size"], use_double_wide_mlp=True,
        final_logit_softcapping=5.0)


GEMMA4_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, head_dim=16, partial_rotary_factor=0.25)


def hybrid_config(arch: str):
    """(config, model class) of a model with Gated DeltaNet layers: three of them, then one full-attention layer
    (q/k norms, an output gate, partial rotary); Qwen3-Next's and Qwen3.5-MoE's MLPs are experts (8, top 2, a shared
    one)."""
    import transformers

    common = {**COMMON, "num_hidden_layers": 4}
    if arch == "qwen3-next":
        return transformers.Qwen3NextConfig(**common, **LINEAR, **EXPERTS, num_experts=8, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=64, norm_topk_prob=True), \
            transformers.Qwen3NextForCausalLM
    if arch == "qwen3.5":
        return transformers.Qwen3_5TextConfig(**common, **LINEAR), transformers.Qwen3_5ForCausalLM
    if arch == "qwen3.5-moe":
        return transformers.Qwen3_5MoeTextConfig(**common, **LINEAR, **EXPERTS, num_experts=8, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=64), \
            transformers.Qwen3_5MoeForCausalLM
    raise ValueError(arch)


def moe_config(arch: str):
    """(config, model class) of a mixture-of-experts `arch`: 8 experts, top 2."""
    import transformers

    if arch == "mixtral":                            # renormalised top 2, every layer sliding
        return transformers.MixtralConfig(**COMMON, **EXPERTS, num_local_experts=8, sliding_window=WINDOW), \
            transformers.MixtralForCausalLM
    if arch == "qwen2-moe":                          # a shared expert with its gate; one dense layer between
        return transformers.Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 3}, **EXPERTS, num_experts=8,
                                           moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                           mlp_only_layers=[1], norm_topk_prob=False), \
            transformers.Qwen2MoeForCausalLM
    if arch == "qwen3-moe":                          # q/k norms, renormalised top 2
        return transformers.Qwen3MoeConfig(**COMMON, **EXPERTS, num_experts=8, head_dim=32, moe_intermediate_size=64,
                                           norm_topk_prob=True), transformers.Qwen3MoeForCausalLM
    if arch == "gemma4-moe":                         # experts beside each dense MLP (26B-A4B), no per-layer inputs
        return transformers.Gemma4TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=WINDOW, layer_types=GEMMA4_LAYERS[:3],
            hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
            moe_intermediate_size=32), \
            transformers.Gemma4ForCausalLM
    if arch == "gpt-oss":                            # top-2 logits then softmax, clamped SwiGLU, sinks, windows
        rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "rope_theta": 150000.0, "original_max_position_embeddings": 256}
        return transformers.GptOssConfig(**COMMON, **EXPERTS, num_local_experts=8, head_dim=16, sliding_window=WINDOW,
                                         swiglu_limit=1.0, rope_parameters=rope), transformers.GptOssForCausalLM
    raise ValueError(arch)


def reference_model(path: Path):
    """transformers' float32 model of the checkpoint at `path`, experts run by its own eager loop (its grouped
    matmul takes no float64, which the tolerance's float64 copy needs)."""
    import transformers

    options, config = {}, transformers.AutoConfig.from_pretrained(path)
    if config.model_type in MOE_MODEL_TYPES or getattr(config, "enable_moe_block", False):
        options["experts_implementation"] = "eager"
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options).eval()


MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text")


def transformers_greedy(model, prompt, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `new_tokens` long, with end-of-sequence neither stopping
    nor suppressed (as the engine's ignore_eos generates: min_new_tokens would mask it)."""
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    assert out.shape[1] == len(prompt) + new_tokens
    return out[0, len(prompt):].tolist()


def make_hf_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a randomly initialised transformers model of `arch` to `out_dir`, in float32."""
    config, model_cls = transformers_config(arch)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _perturb_norms(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _perturb_norms(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias")):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
            elif name.endswith("sinks"):
                param.add_(torch.randn(param.shape, generator=generator))
            elif name.endswith(("router.scale", "per_expert_scale")):     # Gemma 4's router
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):                # Gemma 4's stored output scale of each layer
                buffer.add_(torch.randn(buffer.shape, generator=generator) * 0.1)
