"""GGUF models (llama.cpp's format): found from a --model value, converted once into a cached directory.

`converted_dir(path)` turns a GGUF file into a Hugging Face style directory (config.json,
safetensors, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json)
under the cache folder, keyed by the file's sha256, so the rest of pdserve loads it like any other
checkpoint. The directory also holds `gguf_source.json`: the source file, its hash, and each
tensor's GGUF name and type, for a loader that wants the raw quantized blocks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from pdserve.engine.model.cache import build_once, cache_root
from pdserve.engine.model.gguf_config import FOLDED, hf_config, read_dims
from pdserve.engine.model.gguf_tensors import tensor_specs
from pdserve.engine.model.gguf_reader import GGUFError, GGUFFile
from pdserve.engine.model.gguf_tokenizer import tokenizer_files
from pdserve.engine.model.gguf_weights import check_tensors, converted_tensors, dequantized, write_safetensors

__all__ = ["GGUFError", "converted_dir", "find_gguf"]

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
SOURCE_FILE = "gguf_source.json"
HASH_CHUNK = 1 << 24


def find_gguf(model: str | os.PathLike) -> Path | None:
    """The GGUF file a --model value names: a `*.gguf` file, any file starting with GGUF's magic
    (Ollama's blobs have no suffix), or a directory without config.json that holds exactly one
    `*.gguf`. None otherwise.

    Raises GGUFError for a directory holding several.
    """
    path = Path(model).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_magic(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise GGUFError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}"
                        f"{', ...' if len(found) > 4 else ''}); pass the one to serve")
    return found[0] if found else None


def converted_dir(path: Path) -> Path:
    """The cached Hugging Face style directory of GGUF file `path`, converting it on first use.

    Raises GGUFError naming the file and the tensor or metadata key when it cannot be served;
    nothing is left in the cache then.
    """
    path = Path(path).resolve()
    memo = _hash_memo(path)
    remembered = cache_root() / _dir_name(memo.read_text().strip()) if memo.is_file() else None
    if remembered is not None and remembered.is_dir():
        return remembered
    plan = _Plan(GGUFFile(path))                       # every check that needs no tensor data
    digest = file_sha256(path)
    final = build_once(cache_root() / _dir_name(digest), lambda tmp: plan.write(tmp, digest))
    _write_atomically(memo, digest)
    return final


class _Plan:
    """A GGUF file checked against itself: metadata, tokenizer and every tensor's name, shape and type."""

    def __init__(self, f: GGUFFile) -> None:
        if f.integer("split.count", 1) > 1:
            raise f.error("split GGUF files are not supported; merge them with `llama-gguf-split --merge`")
        self.f = f
        self.dims = read_dims(f)
        self.specs = tensor_specs(f, self.dims)
        check_tensors(f, self.specs, f.arch("block_count"), self.dims.num_layers)
        self.tokenizer = tokenizer_files(f, f.integer(f.arch("context_length")))
        folded = {name: dequantized(f.tensors[name]).float().numpy() for name in FOLDED if name in f.tensors}
        ids = {"bos": self.tokenizer.bos_token_id, "eos": self.tokenizer.eos_token_id}
        self.config = hf_config(f, self.dims, folded, ids)

    def write(self, out: Path, digest: str) -> None:
        started = time.perf_counter()
        logger.info("converting %s (sha256 %s...) once, into %s", self.f.path, digest[:12], cache_root())
        (out / "tokenizer.json").write_text(self.tokenizer.tokenizer_json, encoding="utf-8")
        _write_json(out / "tokenizer_config.json", self.tokenizer.tokenizer_config)
        _write_json(out / "generation_config.json", self._generation_config())
        write_safetensors(converted_tensors(self.f, self.specs), out)
        _write_json(out / SOURCE_FILE, self._source(digest))
        _write_json(out / "config.json", self.config)           # NOTE: last: a directory with it is whole
        logger.info("converted %s in %.1f s", self.f.path.name, time.perf_counter() - started)

    def _generation_config(self) -> dict:
        t = self.tokenizer
        return {"bos_token_id": t.bos_token_id, "eos_token_id": list(t.end_of_generation_ids),
                "pad_token_id": t.pad_token_id}

    def _source(self, digest: str) -> dict:
        tensors = {spec.hf_name: {"gguf_name": name, "type": self.f.tensors[name].tensor_type.name,
                                  "unpermute_heads": spec.unpermute_heads} for name, spec in self.specs.items()}
        return {"gguf_file": str(self.f.path), "sha256": digest, "size": self.f.path.stat().st_size,
                "architecture": self.f.architecture, "tensors": tensors}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _dir_name(digest: str) -> str:
    return f"gguf-{digest[:16]}"


def _hash_memo(path: Path) -> Path:
    """Where this file's hash is remembered, keyed by its path, size, mtime and inode (so a second start
    reads no weights): a changed or replaced file gets a new key and is hashed again."""
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()).hexdigest()[:32]
    return cache_root() / "gguf-hashes" / key


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
