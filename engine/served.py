"""What the engine serves: the model's name, dimensions and tokenizer, resolved once from --model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ServedModel:
    """`tokenizer` None: a simulated model's, whose streams carry token ids and no text."""

    name: str
    model_dir: Path | None
    config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, model: str | None) -> ServedModel:
        """The model a --model value names (`pdserve.engine.model.resolve`), its config and its tokenizer."""
        resolved = resolve_model(model)
        config = ModelConfig.from_dir(resolved.path)
        tokenizer = Tokenizer.from_dir(resolved.path)
        return cls(resolved.name, resolved.path, config, tokenizer,
                   tokenizer.eos_token_ids | frozenset(config.eos_token_ids))
