"""The model's configuration, parsed from a Hugging Face `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.model import gemma4_config
from pdserve.engine.model.config_checks import validate_config
from pdserve.engine.model.experts_config import ExpertsConfig, experts_config
from pdserve.engine.model.kv_placement import KVPlacement
from pdserve.engine.model.recurrent_config import LinearAttentionConfig, linear_attention_config
from pdserve.engine.model.text_of_multimodal import text_config
from pdserve.engine.model.families import (
    ConfigError,
    RopeConfig,
    LayerKind,
    family_features,
    layer_kinds,
    rope_config,
)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
# parsed but not served: the reason a start is refused
UNSERVABLE_ARCHITECTURES: dict[str, tuple[str, str]] = {}

# not parsed: the reason a start is refused
REFUSED_ARCHITECTURES: dict[str, str] = {}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["ConfigError", "ExpertsConfig", "LayerKind", "ModelConfig", "RopeConfig", "SUPPORTED_ARCHITECTURES"]


@dataclass(frozen=True, slots=True)
class ModelConfig(KVPlacement):
    model_dir: Path
    architecture: str                      # SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig                       # the full-attention layers' rotary embedding
    attention_bias: bool                   # q/k/v projections have biases
    qk_norm: bool                          # RMSNorm over each query and key head (Qwen3, Gemma 3)
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype
    layer_kinds: tuple[LayerKind, ...]     # one per layer: its sliding window and rotary embedding
    attention_scale: float = 0.0           # scores times this (0: head_dim ** -0.5)
    attn_softcap: float = 0.0              # scores capped at softcap * tanh(score / softcap) (Gemma 2; 0: none)
    final_softcap: float = 0.0             # the same for the logits
    attention_sinks: bool = False          # a learned logit per head in the softmax denominator (gpt-oss)
    o_proj_bias: bool = False
    hidden_act: str = "silu"               # silu | gelu_pytorch_tanh: the gate's activation
    norm_offset: float = 0.0               # RMSNorm scales by (offset + weight): Gemma's 1.0
    sandwich_norms: bool = False           # RMSNorm on the attention's and the MLP's outputs too (Gemma 2/3)
    embed_scale: float = 1.0               # embeddings times this (Gemma: sqrt(hidden_size))
    experts: ExpertsConfig | None = None   # the expert layers' (LayerKind.experts) mixture of experts
    attention_output_gate: bool = False    # q_proj also gives a gate per head: output * sigmoid(gate) (Qwen3-Next)
    linear_attention: LinearAttentionConfig | None = None   # the recurrent layers' (LayerKind.recurrent)
    value_norm: bool = False               # RMSNorm without a scale over each value head (Gemma 4)
    full_keys_as_values: bool = False      # the full layers' values are their key projection, before its norm
    per_layer_input_size: int = 0          # each layer takes an input of this width per token (Gemma 4; 0: none)
    per_layer_vocab_size: int = 0          # rows of the per-layer inputs' embedding
    layer_scalars: bool = False            # each layer's output is scaled by a stored scalar (Gemma 4)

    @property
    def name(self) -> str:
        return self.model_dir.name

    @property
    def layer_params(self) -> int:
        """Weights one token reads in a layer (the mean over the layers): attention and the MLP, an expert
        layer's active parameters (router, top-k experts, shared expert); norms left out."""
        return self._layers_params(1) // self.num_layers

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_params(self) -> int:
        """Every weight a one-token step reads: the layers (an expert layer's active parameters) and the LM head
        (the embedding lookup reads a row per token)."""
        return self._layers_params(1) + self.lm_head_params

    def params_read(self, tokens: int) -> float:
        """The weights a step of `tokens` tokens reads: the dense ones, and each expert layer's experts those
        tokens touch (expected under uniform routing)."""
        return self._layers_params(tokens) + self.lm_head_params

    @property
    def stored_params(self) -> int:
        """Every weight held: each expert layer's experts all count."""
        return self._layers_params(None) + self.lm_head_params

    def _layers_params(self, tokens: int | None) -> float | int:
        """Weights of every layer read by a step of `tokens` tokens (None: every expert)."""
        total = sum(map(self._layer_params, range(self.num_layers)))
        if self.per_layer_input_size:                 # Gemma 4: the projection to every layer's input
            total += self.hidden_size * self.num_layers * self.per_layer_input_size
        experts = sum(kind.experts for kind in self.layer_kinds)
        if not experts:
            return total
        e, hidden = self.experts, self.hidden_size
        if tokens is None:
            return total + experts * e.stored_params(hidden)
        if tokens == 1:
            return total + experts * e.active_params(hidden)
        return total + experts * (e.fixed_params(hidden) + e.experts_touched(tokens) * e.expert_params(hidden))

    def _layer_params(self, i: int) -> int:
        """Layer i's weights but its experts': attention (or the recurrent mixer), the dense MLP where it has one,
        Gemma 4's per-layer input projections."""
        kind, hidden = self.layer_kinds[i], self.hidden_size
        if kind.recurrent:
            mixer = self.linear_attention.layer_params(hidden)
        else:
            q = self.num_heads * self.layer_head_dim(i)
            kv = self.layer_kv_heads(i) * self.layer_head_dim(i)
            kept = 0 if kind.reuses_kv else kv if self.full_keys_as_values and not kind.window else 2 * kv
            mixer = hidden * ((3 if self.attention_output_gate else 2) * q + kept)
        dense = not kind.experts or self.architecture == "gemma4"      # Gemma 4's experts sit beside it
        mlp = 3 * hidden * (kind.intermediate_size or self.intermediate_size) if dense else 0
        return mixer + mlp + 2 * hidden * self.per_layer_input_size

    def state_bytes(self) -> int:
        """One sequence's recurrent state over every recurrent layer (0 without any)."""
        return 0 if self.linear_attention is None else self.linear_attention.state_bytes(self.num_recurrent_layers)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Parse `config.json` of a Hugging Face style directory; raises ConfigError naming the file."""
        path = Path(model_dir) / "config.json"
        config = parse_config(Path(model_dir), text_config(_read_json(path)), path)
        refusal = next((reason for arch, reason in UNSERVABLE_ARCHITECTURES.values() if arch == config.architecture),
                       None)
        if refusal is not None:
            raise ConfigError(f"{path}: architecture {config.architecture!r} cannot be served: {refusal}; "
                              f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        return config

    @property
    def scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.attention_scale or self.head_dim ** -0.5


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def parse_config(model_dir: Path, raw: dict, path: Path) -> ModelConfig:
    """A config.json's contents as a ModelConfig, any architecture pdserve parses (served or not)."""
    architecture = _architecture(raw, path)
    try:
        if architecture == "gemma4":
            raw = gemma4_config.with_defaults(raw)
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_layers = int(raw["num_hidden_layers"])
        rope = rope_config(raw)
        config = ModelConfig(
            model_dir=model_dir,
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or raw["moe_intermediate_size"]),  # Qwen3.5-MoE
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", architecture.startswith("gemma"))),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            checkpoint_dtype=DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                                        torch.float32),
            layer_kinds=layer_kinds(raw, architecture, num_layers, rope),
            experts=experts_config(raw, architecture),
            linear_attention=linear_attention_config(raw, architecture),
            **family_features(raw, architecture, hidden),
        )
    except KeyError as e:
        raise ConfigError(f"{path}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: invalid value: {e}") from None
    validate_config(config, path)
    return config


def _architecture(raw: dict, path: Path) -> str:
    names = raw.get("architectures") or []
    known = {**SUPPORTED_ARCHITECTURES, **{name: arch for name, (arch, _) in UNSERVABLE_ARCHITECTURES.items()}}
    for name in names:
        if name in known:
            return known[name]
        if name in REFUSED_ARCHITECTURES:
            raise ConfigError(f"{path}: architecture {name!r} cannot be served: {REFUSED_ARCHITECTURES[name]}; "
                              f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    raise ConfigError(f"{path}: unsupported architecture {names or raw.get('model_type')!r}; "
                      f"supported: {supported}")


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
