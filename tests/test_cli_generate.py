"""`pdserve make-model` and `pdserve generate` as a user runs them (subprocesses)."""
from __future__ import annotations

import json
import subprocess
import sys

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM


def pdserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.server.cli", *args], capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_make_model_then_generate_prints_one_json_object_per_prompt(tmp_path):
    model = tmp_path / "model"
    made = pdserve("make-model", str(model), "--size", "tiny", "--arch", "qwen2", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    result = pdserve("generate", "--model", str(model), "--max-tokens", "8", "--ignore-eos", "--seed", "5",
                     "--temperature", "0.8", "--mode", "colocated", "--kv-cache-memory", "32MiB",
                     "hello there", "a second prompt")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["hello there", "a second prompt"]
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 8 for r in records)
    llm = LLM(str(model), mode="disaggregated", dtype=None)
    try:
        again = llm.generate(["hello there"], SamplingParams(max_tokens=8, temperature=0.8, seed=5,
                                                             ignore_eos=True))[0]
    finally:
        llm.close()
    assert list(again.token_ids) == records[0]["token_ids"]
    assert again.text == records[0]["text"]


def test_generate_reports_a_bad_model_directory_clearly(tmp_path):
    result = pdserve("generate", "--model", str(tmp_path / "missing"), "hi")
    assert result.returncode != 0
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
