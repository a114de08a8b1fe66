"""Checkpoints whose language model pdserve serves as text though they carry more: Qwen3.5 and Gemma 3 and 4 as
published (`...ForConditionalGeneration`, with a vision tower) and Qwen3-Next / Qwen3.5's multi-token
prediction head (`mtp.`). Their config.json nests the language model's keys under `text_config`; their
tensors prefix its names (`model.language_model.` since transformers 5, `language_model.model.` before).
The vision and audio towers, their projectors and the prediction head are not read."""
from __future__ import annotations

import re

TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
}
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
NOT_READ = re.compile(r"^(model\.)?(visual|vision_tower|multi_modal_projector|audio_tower|embed_vision|embed_audio)\."
                      r"|^mtp\.")


def text_config(raw: dict) -> dict:
    """The language model's config.json keys: a multimodal checkpoint's `text_config` over its own keys, named
    as the causal LM it is; any other config as it is."""
    wrapper = next((name for name in raw.get("architectures") or [] if name in TEXT_MODEL_OF), None)
    text = raw.get("text_config")
    if wrapper is None or not isinstance(text, dict):
        return raw
    outer = {key: value for key, value in raw.items() if key not in ("text_config", "vision_config")}
    return {**outer, **text, "architectures": [TEXT_MODEL_OF[wrapper]]}


def text_name(stored: str) -> str | None:
    """A stored tensor's name as the causal LM names it; None for a tensor pdserve does not read."""
    if NOT_READ.match(stored):
        return None
    for prefix, replacement in TEXT_PREFIXES:
        if stored.startswith(prefix):
            return replacement + stored[len(prefix):]
    return stored
