"""GGUF blocks in the model: where they land (fused projections, Hugging Face row order, one segment a part),
the mapped block cache, no float copy, the start-up report, the probe, and a GGUF of another model refused.

The files are tests/test_quant_model.py's: written with gguf.GGUFWriter from the tiny checkpoints, q/k rows
permuted as llama.cpp's converter does, the projections' safetensors the blocks dequantized.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.model import gguf_block_cache, quant, quant_probe
from pdserve.engine.model.gguf_blocks import GGUFBlockError, unpermute_rows
from pdserve.engine.model.gguf_modules import GGUFEmbedding, GGUFLinear
from pdserve.engine.model.quant import quantize_model
from pdserve.engine.worker.model_runner import load_model
from pdserve.kernels.gguf_formats import dequantize_reference
from pdserve.kernels.gguf_linear import native_available
from tests.models import demo_checkpoint
from tests.test_quant_model import (  # noqa: F401
    gguf_entries,
    kernel_for_every_batch,
    llama_cpp_permute,
    read_tensors,
    write_gguf_model,
)

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler for the native kernels")


def test_gguf_blocks_land_in_the_fused_projections_in_hugging_face_row_order(tmp_path):
    model_dir = write_gguf_model(demo_checkpoint("llama"), tmp_path / "gguf")
    config, dense = ModelConfig.from_dir(model_dir), read_tensors(model_dir)
    assert not config.tie_word_embeddings
    read = gguf_block_cache.cached_gguf_blocks(model_dir / "model.gguf", config, tied_head=False)
    qkv = torch.cat([dense[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(dequantize_reference(read.matrices["layers.0.self_attn.qkv_proj"]), qkv)
    assert read.matrices["layers.0.self_attn.qkv_proj"].types == ("Q4_1", "Q4_1", "Q5_0")
    assert torch.equal(dequantize_reference(read.matrices["lm_head"]), dense["lm_head.weight"])
    gate_up = read.matrices["layers.1.mlp.gate_up_proj"]                       # mixed: one segment a part
    assert gate_up.types == ("Q4_1", "Q8_0")
    assert torch.equal(dequantize_reference(gate_up), torch.cat([dense[f"model.layers.1.mlp.{p}_proj.weight"]
                                                                 for p in ("gate", "up")]))
    assert set(read.skipped) == {"layers.1.self_attn.o_proj", "embed_tokens"}    # F32; no token_embd here
    assert read.skipped["layers.1.self_attn.o_proj"].endswith("F32")


def test_gguf_blocks_are_read_once_then_mapped_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = write_gguf_model(demo_checkpoint("qwen2"), tmp_path / "gguf")
    config, path = ModelConfig.from_dir(model_dir), model_dir / "model.gguf"
    first = gguf_block_cache.cached_gguf_blocks(path, config, tied_head=True)

    def unread(*args):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_block_cache, "read_gguf_blocks", unread)
    again = gguf_block_cache.cached_gguf_blocks(path, config, tied_head=True)
    assert again.skipped == first.skipped and again.matrices.keys() == first.matrices.keys()
    for name, matrix in first.matrices.items():
        assert torch.equal(dequantize_reference(again.matrices[name]), dequantize_reference(matrix))
        assert again.matrices[name].types == matrix.types
        assert all(s.data.untyped_storage().filename for s in matrix.segments)     # mapped, not copied
    os.utime(path, ns=(1, 1))                                   # NOTE: a changed file is read again
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_block_cache.cached_gguf_blocks(path, config, tied_head=True)


def test_no_float_copy_of_the_blocks_is_loaded(tmp_path, monkeypatch, kernel_for_every_batch):
    """Every quantized projection and the tied embedding hold only their blocks; the loader never reads
    their float tensors from the checkpoint."""
    model_dir = write_gguf_model(demo_checkpoint("qwen2"), tmp_path / "gguf")
    read = []
    real = quant.load_weights
    monkeypatch.setattr(quant, "load_weights", lambda model, path, skip: read.append(skip) or real(model, path, skip))
    model = load_model(ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"), 64, "gguf")
    held = {n for n, m in model.named_modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))}
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert len(held) == 2 + 4 * model.config.num_layers - 1                # layer 1's F32 o_proj stays dense
    assert {f"{n}.weight" for n in held} | {"lm_head.weight"} == set(read[0])
    floats = [p for n, p in (*model.named_parameters(), *model.named_buffers())
              if p.dim() == 2 and p.numel() > 0 and n != "cos_sin"]           # NOTE: cos_sin: the rotary table
    assert [p.shape for p in floats] == [model.layers[1].self_attn.o_proj.weight.shape]


def test_the_start_up_report_counts_every_tensor_type(tmp_path, caplog, kernel_for_every_batch):
    model_dir = write_gguf_model(demo_checkpoint("llama"), tmp_path / "gguf")
    with caplog.at_level("INFO", logger="pdserve.engine.model.quant"):
        load_model(ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"), 64, "gguf")
    lines = [r.getMessage() for r in caplog.records if "quantization gguf" in r.getMessage()]
    assert len(lines) == 1
    for kind, count in Counter(kind for _, _, kind, _ in gguf_entries(demo_checkpoint("llama"))).items():
        if kind != "F32":
            assert f"{kind}: {count} from blocks" in lines[0]
    assert "F32: 1 not from blocks" in lines[0] and "layers.1.self_attn.o_proj" in lines[0]


def test_unpermute_rows_inverts_llama_cpp_permutation():
    rows = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)
    assert np.array_equal(llama_cpp_permute(rows, 6)[unpermute_rows(48, 6)], rows)


def test_gguf_of_another_model_is_refused(tmp_path):
    model_dir = write_gguf_model(demo_checkpoint("llama"), tmp_path / "gguf")
    other = make_other_checkpoint(tmp_path / "other")
    model = load_model(ModelConfig.from_dir(other), torch.float32, torch.device("cpu"), 64)
    with pytest.raises(GGUFBlockError, match="does not hold the model's loaded weights"):
        quantize_model(model, "gguf", model_dir / "model.gguf", threads=1)
    decision = quantize_model(model, "auto", model_dir / "model.gguf", threads=1)      # auto: stays dense
    assert decision.scheme == "none" and "does not hold" in decision.reason


def make_other_checkpoint(out: Path) -> Path:
    from pdserve.engine.model.demo import make_model

    return make_model(out, size="tiny", arch="llama", seed=1)


def test_probe_of_blocks_against_tiles_returns_timings(tmp_path):
    model_dir = write_gguf_model(demo_checkpoint("llama"), tmp_path / "gguf")
    read = gguf_block_cache.cached_gguf_blocks(model_dir / "model.gguf", ModelConfig.from_dir(model_dir), False)
    matrices = [read.matrices[f"layers.{i}.mlp.gate_up_proj"] for i in range(2)]
    result = quant_probe.probe_blocks(matrices, torch.float32, threads=1, batch_sizes=(1, 2))
    assert result.timings and all(tiles > 0 and blocks > 0 for _, tiles, blocks in result.timings)
    assert result.max_rows in (0, 1, 2)
