"""What a mixture-of-experts family's config.json says about its expert layers, as transformers reads it.

Mixtral, Qwen2/3-MoE and Qwen3-Next score every expert with a softmax and keep the top k (Mixtral renormalises them;
Qwen by `norm_topk_prob`); gpt-oss keeps the top k router logits (its router has a bias) and takes their
softmax. Qwen2-MoE and Qwen3-Next add a shared expert every token takes, scaled by a sigmoid gate; gpt-oss's experts
have biases and a clamped SwiGLU. Qwen's `mlp_only_layers` and `decoder_sparse_step` leave some layers dense.
"""
from __future__ import annotations

from dataclasses import dataclass

ROUTINGS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped", "gelu_tanh")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe")
SHARED_EXPERT = ("qwen2_moe", "qwen3_next", "qwen3_5_moe")
RENORMALISED_BY_DEFAULT = ("qwen3_next", "qwen3_5_moe")   # top-k weights sum to 1 without norm_topk_prob


@dataclass(frozen=True, slots=True)
class ExpertsConfig:
    num_experts: int
    top_k: int
    intermediate_size: int                 # each expert's
    routing: str = "softmax_topk"          # ROUTINGS: softmax over all then top k, or top k logits then softmax
    norm_topk_prob: bool = True            # softmax_topk: the k probabilities renormalised to sum to 1
    router_bias: bool = False
    expert_bias: bool = False              # gate/up and down projections of each expert have biases
    activation: str = "silu"               # EXPERT_ACTIVATIONS: silu(gate) * up, gpt-oss's clamped SwiGLU, GeGLU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0      # a dense expert every token takes (0: none)
    shared_gate: bool = False              # the shared expert's output times sigmoid(x . gate)
    router_scales: bool = False            # a scale per channel of the router's input and per expert (Gemma 4)

    def expert_params(self, hidden: int) -> int:
        """One expert's weights: its gate, up and down projections."""
        return 3 * hidden * self.intermediate_size

    def fixed_params(self, hidden: int) -> int:
        """What every token reads whichever experts it takes: the router and the shared expert with its gate."""
        scales = (hidden + self.num_experts) * self.router_scales
        return (hidden * self.num_experts + 3 * hidden * self.shared_intermediate_size + hidden * self.shared_gate
                + scales)

    def active_params(self, hidden: int) -> int:
        """The weights one token reads: the router, its top_k experts, the shared expert."""
        return self.fixed_params(hidden) + self.top_k * self.expert_params(hidden)

    def stored_params(self, hidden: int) -> int:
        return self.fixed_params(hidden) + self.num_experts * self.expert_params(hidden)

    def experts_touched(self, tokens: int) -> float:
        """The experts a step of `tokens` tokens reads, expected under uniform routing."""
        if tokens <= 0:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)


def experts_config(raw: dict, architecture: str) -> ExpertsConfig | None:
    """The expert layers' configuration (None: a dense family)."""
    if architecture == "gemma4" and raw.get("enable_moe_block"):       # beside each layer's dense MLP
        experts, top_k = int(raw["num_experts"]), int(raw["top_k_experts"])
        if experts <= 0 or not 0 < top_k <= experts:
            raise ValueError(f"top_k_experts ({top_k}) must be between 1 and the number of experts ({experts})")
        return ExpertsConfig(experts, top_k, int(raw["moe_intermediate_size"]), activation="gelu_tanh",
                             router_scales=True)
    if architecture not in MOE_ARCHITECTURES:
        return None
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if experts == 0 and architecture in RENORMALISED_BY_DEFAULT:          # every MLP dense
        return None
    top_k = int(raw["num_experts_per_tok"])
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({experts})")
    if architecture == "gpt_oss":
        method = (raw.get("quantization_config") or {}).get("quant_method")
        if method is not None:
            raise ValueError(f"quantization_config.quant_method {method!r}: gpt-oss's quantized expert blocks are "
                             f"not read; serve a bfloat16 copy (transformers: Mxfp4Config(dequantize=True), then "
                             f"save_pretrained)")
        return ExpertsConfig(experts, top_k, int(raw["intermediate_size"]), routing="topk_softmax",
                             router_bias=True, expert_bias=True, activation="swiglu_clamped",
                             swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                             swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    if architecture == "mixtral":
        return ExpertsConfig(experts, top_k, int(raw["intermediate_size"]))
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if architecture in SHARED_EXPERT else 0
    return ExpertsConfig(experts, top_k, int(raw["moe_intermediate_size"]),
                         norm_topk_prob=bool(raw.get("norm_topk_prob", architecture in RENORMALISED_BY_DEFAULT)),
                         shared_intermediate_size=shared, shared_gate=shared > 0)


def expert_layers(raw: dict, architecture: str, n: int) -> list[bool]:
    """Which layers' MLP is a mixture of experts (Qwen: not `mlp_only_layers`, every `decoder_sparse_step`-th;
    Gemma 4's, with `enable_moe_block`, has experts beside the dense MLP in every layer)."""
    if architecture == "gemma4":
        return [bool(raw.get("enable_moe_block"))] * n
    if architecture not in MOE_ARCHITECTURES:
        return [False] * n
    if architecture in ("mixtral", "gpt_oss"):
        return [True] * n
    if not int(raw.get("num_local_experts") or raw.get("num_experts") or 0):
        return [False] * n
    dense = set(raw.get("mlp_only_layers") or ())
    step = int(raw.get("decoder_sparse_step") or 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]
