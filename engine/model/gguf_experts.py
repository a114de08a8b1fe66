"""Mixture-of-experts GGUF files: llama.cpp's expert metadata and stacked expert tensors, as Hugging Face names.

llama.cpp stores a layer's experts stacked, one tensor per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`: [experts, out, in]), its router as `ffn_gate_inp`, a Qwen shared expert as `ffn_*_shexp`
with its gate `ffn_gate_inp_shexp`, and calls Mixtral `llama` with an expert count. The conversion writes them
back as the checkpoint had them: one tensor per expert (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj), or
gpt-oss's stacked `gate_up_proj` (gate and up interleaved) and `down_proj`, both [experts, in, out]. What the
file leaves to llama.cpp's model code is taken from there: Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE renormalise
their top-k weights and Qwen2-MoE does not; gpt-oss's SwiGLU has alpha 1.702 and limit 7.
"""
from __future__ import annotations

NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "qwen3next": True, "qwen35moe": True}
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}        # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


def is_expert_layer(f, i: int) -> bool:
    return f"blk.{i}.ffn_gate_inp.weight" in f.tensors


def expert_count(f) -> int:
    return f.integer(f.arch("expert_count"), 0)


def expert_config(f, d) -> dict:
    """config.json's expert keys (none for a dense file); Mixtral's architecture for a `llama` file with experts."""
    count = expert_count(f)
    if not count:
        return {}
    used, ffn = f.integer(f.arch("expert_used_count")), expert_ffn(f)
    if f.architecture == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": count,
                "num_experts_per_tok": used, "intermediate_size": ffn, "sliding_window": None}
    if f.architecture == "gpt-oss":
        return {"num_local_experts": count, "num_experts_per_tok": used, "intermediate_size": ffn, **SWIGLU}
    config = {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": ffn,
              "norm_topk_prob": NORM_TOPK[f.architecture], "decoder_sparse_step": 1,
              "mlp_only_layers": [i for i in range(d.num_layers) if not is_expert_layer(f, i)]}
    if shared_ffn(f):
        config["shared_expert_intermediate_size"] = shared_ffn(f)
    return config


def expert_ffn(f) -> int:
    """Each expert's size (Mixtral files give it as the feed-forward length)."""
    key = f.arch("expert_feed_forward_length")
    return f.integer(key) if key in f else f.integer(f.arch("feed_forward_length"))


def shared_ffn(f) -> int:
    return f.integer(f.arch("expert_shared_feed_forward_length"), 0)


def expert_tensors(f, d, i: int) -> dict[str, tuple[str, tuple[int, ...], str, dict]]:
    """Layer i's router, experts and shared expert: GGUF name -> (Hugging Face name, shape in the file, the keys
    the shape comes from, TensorSpec options)."""
    a, hidden, count, ffn = f.arch, d.hidden_size, expert_count(f), expert_ffn(f)
    keys = f"{a('expert_count')}, {a('expert_feed_forward_length')}, {a('embedding_length')}"
    up, down = (count, ffn, hidden), (count, hidden, ffn)
    router = ((count, hidden), f"{a('expert_count')}, {a('embedding_length')}")
    if f.architecture == "gpt-oss":
        m, pair = f"model.layers.{i}.mlp", dict(transposed=True)
        return {"ffn_gate_inp.weight": (f"{m}.router.weight", *router, {}),
                "ffn_gate_inp.bias": (f"{m}.router.bias", (count,), a("expert_count"), {}),
                "ffn_gate_exps.weight": (f"{m}.experts.gate_up_proj", up, keys, pair | {"part": (0, 2)}),
                "ffn_up_exps.weight": (f"{m}.experts.gate_up_proj", up, keys, pair | {"part": (1, 2)}),
                "ffn_gate_exps.bias": (f"{m}.experts.gate_up_proj_bias", (count, ffn), keys, {"part": (0, 2)}),
                "ffn_up_exps.bias": (f"{m}.experts.gate_up_proj_bias", (count, ffn), keys, {"part": (1, 2)}),
                "ffn_down_exps.weight": (f"{m}.experts.down_proj", down, keys, pair),
                "ffn_down_exps.bias": (f"{m}.experts.down_proj_bias", (count, hidden), keys, {})}
    mixtral = f.architecture == "llama"
    m = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}"
    gate, up_name, down_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    split = {"experts": True}
    specs = {"ffn_gate_inp.weight": (f"{m}.gate.weight", *router, {}),
             "ffn_gate_exps.weight": (f"{m}.experts.{{expert}}.{gate}.weight", up, keys, split),
             "ffn_up_exps.weight": (f"{m}.experts.{{expert}}.{up_name}.weight", up, keys, split),
             "ffn_down_exps.weight": (f"{m}.experts.{{expert}}.{down_name}.weight", down, keys, split)}
    shared = shared_ffn(f)
    if shared:
        shared_keys = f"{a('expert_shared_feed_forward_length')}, {a('embedding_length')}"
        specs |= {"ffn_gate_shexp.weight": (f"{m}.shared_expert.gate_proj.weight", (shared, hidden), shared_keys, {}),
                  "ffn_up_shexp.weight": (f"{m}.shared_expert.up_proj.weight", (shared, hidden), shared_keys, {}),
                  "ffn_down_shexp.weight": (f"{m}.shared_expert.down_proj.weight", (hidden, shared), shared_keys,
                                            {}),
                  "ffn_gate_inp_shexp.weight": (f"{m}.shared_expert_gate.weight", (1, hidden), a("embedding_length"),
                                                {})}
    return specs
