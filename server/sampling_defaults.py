"""Sampling defaults for the fields a request leaves out: the model's generation_config.json, as vLLM's
--generation-config reads it."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.server.protocol import ParsedRequest

logger = logging.getLogger(__name__)

# the keys vLLM takes from generation_config.json; max_new_tokens is the default max_tokens
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    sampling: Mapping[str, float | int] = field(default_factory=dict)   # SamplingParams keyword arguments
    max_tokens: int | None = None        # a request without max_tokens gets at most this many


def load_defaults(setting: str, model_dir: Path, override: Mapping[str, Any]) -> SamplingDefaults:
    """`setting` auto: `model_dir`'s generation_config.json; vllm: none; else a folder holding that file.
    `override` goes over it. Raises ValueError naming the file and key of a value out of range."""
    source = {"auto": model_dir, "vllm": None}.get(setting, Path(setting))
    path = source / "generation_config.json" if source is not None else None
    config = _read(path) if path is not None and path.is_file() else {}
    values = {k: config[k] for k in GENERATION_CONFIG_KEYS if config.get(k) is not None}
    check_defaults(values, str(path))
    values.update(override)
    if values:
        logger.info("sampling defaults for fields a request leaves out: %s (from %s; --generation-config vllm "
                    "turns them off)", values, path if config else "--override-generation-config")
    max_tokens = values.pop("max_new_tokens", None)
    return SamplingDefaults(values, max_tokens)


def check_defaults(values: Mapping[str, Any], source: str) -> None:
    """ValueError naming `source` and the key when a value is not a valid sampling parameter."""
    for key, value in values.items():
        if key not in GENERATION_CONFIG_KEYS:
            raise ValueError(f"{source}: unknown sampling default {key!r}")
        integer = key in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ValueError(f"{source}: {key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    try:
        SamplingParams(max_tokens=max(1, values.get("max_new_tokens", 1)),
                       **{k: v for k, v in values.items() if k != "max_new_tokens"})
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if values.get("max_new_tokens", 1) < 1:
        raise ValueError(f"{source}: max_new_tokens must be at least 1")


def _read(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def with_defaults(parsed: ParsedRequest, defaults: SamplingDefaults) -> ParsedRequest:
    """`parsed` with the defaults in the sampling fields it left out (max_tokens: a cap on the rest of the
    context window, as vLLM applies max_new_tokens)."""
    if not defaults.sampling and defaults.max_tokens is None:
        return parsed
    cap = parsed.max_tokens_cap
    if parsed.max_tokens is None and defaults.max_tokens is not None:
        cap = min(cap, defaults.max_tokens)
    return replace(parsed, sampling={**defaults.sampling, **parsed.sampling}, max_tokens_cap=cap)
