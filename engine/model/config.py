"""The model's configuration, parsed from a Hugging Face `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A model directory whose configuration cannot be used."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"            # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_dir: Path
    architecture: str                      # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.model_dir.name

    @property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections and the gated MLP (norms left out)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q_out + 2 * kv_out) + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_params(self) -> int:
        """Every weight a step reads: the layers and the LM head (the embedding lookup reads a row per token)."""
        return self.num_layers * self.layer_params + self.lm_head_params

    def kv_elements_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Parse `config.json` of a Hugging Face style directory; raises ConfigError naming the file."""
        path = Path(model_dir) / "config.json"
        raw = _read_json(path)
        return _model_config_from_dict(Path(model_dir), raw, path)


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


def _model_config_from_dict(model_dir: Path, raw: dict, path: Path) -> ModelConfig:
    architecture = _architecture(raw, path)
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        config = ModelConfig(
            model_dir=model_dir,
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_rope_config(raw),
            attention_bias=bool(raw.get("attention_bias", architecture == "qwen2")),
            qk_norm=architecture == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw, architecture),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            checkpoint_dtype=DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                                        torch.float32),
        )
    except KeyError as e:
        raise ConfigError(f"{path}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: invalid value: {e}") from None
    _validate(config, path)
    return config


def _architecture(raw: dict, path: Path) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    raise ConfigError(f"{path}: unsupported architecture {names or raw.get('model_type')!r}; "
                      f"supported: {supported}")


def _rope_config(raw: dict) -> RopeConfig:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(raw: dict, architecture: str) -> int | None:
    window = raw.get("sliding_window")
    if architecture in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def _validate(c: ModelConfig, path: Path) -> None:
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings")
    for name in positive:
        if getattr(c, name) <= 0:
            raise ConfigError(f"{path}: {name} must be positive, got {getattr(c, name)}")
    if c.num_heads % c.num_kv_heads:
        raise ConfigError(f"{path}: num_attention_heads ({c.num_heads}) is not a multiple of "
                          f"num_key_value_heads ({c.num_kv_heads})")
