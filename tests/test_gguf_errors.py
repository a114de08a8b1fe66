"""A GGUF file that cannot be served fails with one line naming the file and the tensor or key, a
non-zero exit from `pdserve`, and nothing left in the cache."""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import pytest

from pdserve.engine.model.gguf import GGUFError, converted_dir
from tests.gguf_models import Q, corrupt_tensor, make_transformers_model, write_gguf

REPO = Path(__file__).resolve().parent.parent
V = gguf.GGUFValueType
TYPES = {"attn": Q.Q8_0, "ffn": Q.Q8_0, "token_embd": Q.Q8_0}


@functools.cache
def model():
    return make_transformers_model("llama", tied=True)


@functools.cache
def good_file() -> Path:
    return write_gguf(model(), Path(tempfile.mkdtemp(prefix="pdserve-gguf-errors-")) / "good.gguf", TYPES)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fails(path: Path, cache: Path, pattern: str) -> str:
    """Convert `path`; it must raise one GGUFError line naming the file and matching `pattern`."""
    with pytest.raises(GGUFError) as e:
        converted_dir(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path.resolve()}: ")
    assert re.search(pattern, message), message
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())
    return message


def variant(tmp_path: Path, **kwargs) -> Path:
    return write_gguf(model(), tmp_path / "bad.gguf", kwargs.pop("types", TYPES), **kwargs)


def test_truncated_file(tmp_path, cache):
    data = good_file().read_bytes()
    for keep in (len(data) - 1000, len(data) // 3, 100, 0):
        (tmp_path / "cut.gguf").write_bytes(data[:keep])
        fails(tmp_path / "cut.gguf", cache, "not a readable GGUF file, truncated or corrupt")


def test_corrupt_header(tmp_path, cache):
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + good_file().read_bytes()[4:])
    fails(tmp_path / "bad.gguf", cache, "magic")


def test_corrupt_tensor_data(tmp_path, cache):
    path = Path(shutil.copy(good_file(), tmp_path / "bad.gguf"))
    corrupt_tensor(path, "blk.1.ffn_up.weight")
    fails(path, cache, r"tensor blk\.1\.ffn_up\.weight holds non-finite values")


def test_unsupported_architecture(tmp_path, cache):
    fails(variant(tmp_path, arch="bloom"), cache, r"unsupported architecture 'bloom' \(general\.architecture\); "
                                                  r"supported: llama, qwen2, qwen3, gemma2, gemma3, gemma4, phi3, "
                                                  r"smollm3")


def test_a_dense_file_claiming_gpt_oss_names_the_tensor_gpt_oss_needs(tmp_path, cache):
    fails(variant(tmp_path, arch="gpt-oss"), cache, r"missing tensor blk\.0\.post_attention_norm\.weight \(\+\d+ more\); "
                                                    r"gpt-oss\.block_count and the architecture call for it")


def test_a_dense_file_claiming_gemma4_names_the_per_layer_key_gemma4_needs(tmp_path, cache):
    fails(variant(tmp_path, arch="gemma4"), cache, r"metadata key gemma4\.attention\.sliding_window_pattern is missing")


def test_unsupported_tensor_type(tmp_path, cache):
    path = variant(tmp_path, types={"blk.0.ffn_up": Q.Q8_1, **TYPES})
    fails(path, cache, r"tensor blk\.0\.ffn_up\.weight has type Q8_1, which the gguf package cannot dequantize")


@pytest.mark.parametrize("metadata, pattern", [
    ({"llama.embedding_length": (320, V.UINT32)},
     r"tensor token_embd\.weight has shape \(1024, 256\), but llama\.vocab_size, llama\.embedding_length "
     r"make it \(1024, 320\)"),
    ({"llama.attention.head_count_kv": (4, V.UINT32)},
     r"tensor blk\.0\.attn_k\.weight has shape \(128, 256\), but llama\.attention\.head_count_kv"),
    ({"llama.block_count": (3, V.UINT32)},
     r"missing tensor blk\.2\.attn_norm\.weight \(\+8 more\); llama\.block_count"),
    ({"llama.block_count": (1, V.UINT32)}, r"unexpected tensor blk\.1\.\S+ for llama with llama\.block_count = 1"),
    ({"llama.vocab_size": (1000, V.UINT32)}, r"tensor token_embd\.weight has shape \(1024, 256\).*\(1000, 256\)"),
    ({"llama.context_length": None}, r"metadata key llama\.context_length is missing"),
    ({"llama.attention.head_count": (3, V.UINT32)}, r"llama\.attention\.head_count_kv = 2 does not divide"),
    ({"tokenizer.ggml.model": ("t5", V.STRING)}, r"tokenizer\.ggml\.model = 't5' is not supported"),
    ({"tokenizer.ggml.eos_token_id": (5000, V.UINT32)}, r"tokenizer\.ggml\.eos_token_id = 5000 is outside"),
    ({"llama.rope.scaling.type": ("dynamic", V.STRING)}, r"llama\.rope\.scaling\.type = 'dynamic' is not supported"),
    ({"llama.rope.dimension_count": (7, V.UINT32)}, r"llama\.rope\.dimension_count = 7: a rotary embedding must"),
])
def test_metadata_that_disagrees_with_the_tensors(tmp_path, cache, metadata, pattern):
    fails(variant(tmp_path, metadata=metadata), cache, pattern)


def pdserve(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PDSERVE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pdserve.server.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)


def test_pdserve_reports_a_bad_gguf_in_one_line_and_exits_non_zero(tmp_path, cache):
    path = Path(shutil.copy(good_file(), tmp_path / "bad.gguf"))
    corrupt_tensor(path, "blk.0.attn_q.weight")
    generate = pdserve(cache, "generate", "--model", str(path), "hi")
    assert generate.returncode != 0 and generate.stdout == ""
    assert generate.stderr.splitlines() == [f"pdserve generate: error: {path}: tensor blk.0.attn_q.weight holds "
                                            f"non-finite values: the file is corrupt"]
    (tmp_path / "cut.gguf").write_bytes(good_file().read_bytes()[:5000])
    serve = pdserve(cache, "serve", "--model", str(tmp_path / "cut.gguf"), "--port", "0")
    errors = [line for line in serve.stderr.splitlines() if " ERROR " in line]
    assert serve.returncode == 1 and len(errors) == 1, serve.stderr
    assert f"cannot serve: {tmp_path / 'cut.gguf'}: not a readable GGUF file" in errors[0]
    assert not cache.exists() or not any(cache.iterdir())
