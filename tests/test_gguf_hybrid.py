"""Hybrid GGUF files beyond what tests/test_gguf_families.py checks of every family: Qwen3-Next's in_proj_qkvz
as older converters wrote it (whole, `ssm_in`), a Qwen3.5 checkpoint directory beside its GGUF (both with an
MTP block, which is not served), and metadata that disagrees with the tensors."""
from __future__ import annotations

import gguf
import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from pdserve.engine.model.gguf import converted_dir
from pdserve.engine.model.gguf_reader import GGUFError
from pdserve.engine.model.weights import checkpoint_files
from tests.gguf_models import float_tensors, model_logits, rewritten
from tests.test_gguf_families import FIXTURES, cache, gguf_file, prompts, reference  # noqa: F401 (cache: autouse)
from tests.tolerance import assert_float32_close, reference_logits

V = gguf.GGUFValueType


def weights(model_dir):
    return {k: v for path in set(checkpoint_files(model_dir).values()) for k, v in load_file(path).items()}


def test_older_qwen3next_files_holding_in_proj_qkvz_whole_give_the_same_weights(tmp_path):
    """Until llama.cpp's converter split it into attn_qkv and attn_gate, it wrote in_proj_qkvz as it is, `ssm_in`
    (which llama.cpp still reads)."""
    checkpoint = load_file(FIXTURES / "qwen3next" / "model.safetensors")
    tensors = []
    for name, values, kind in float_tensors(gguf_file("qwen3next")):
        block, _, rest = name.removeprefix("blk.").partition(".")
        if rest == "attn_qkv.weight":
            whole = checkpoint[f"model.layers.{block}.linear_attn.in_proj_qkvz.weight"].float().numpy()
            tensors.append((f"blk.{block}.ssm_in.weight", whole, None))
        elif rest != "attn_gate.weight":
            tensors.append((name, values, kind))
    older = weights(converted_dir(rewritten(gguf_file("qwen3next"), tmp_path / "older.gguf", tensors)))
    newer = weights(converted_dir(gguf_file("qwen3next")))
    assert older.keys() == newer.keys()
    assert all(older[k].float().equal(newer[k].float()) for k in newer)


def test_a_qwen35_checkpoint_directory_loads_beside_its_mtp_block():
    """The checkpoint's `mtp.*` tensors are left out, as transformers leaves them out."""
    with safe_open(FIXTURES / "qwen35" / "model.safetensors", framework="pt") as f:
        assert any(name.startswith("mtp.") for name in f.keys())
    assert not any(name.startswith("mtp.") for name in checkpoint_files(FIXTURES / "qwen35"))
    model, batch = reference("qwen35"), prompts(384, seed=3, lengths=(6, 50))
    for prompt, ours in zip(batch, model_logits(FIXTURES / "qwen35", batch)):
        assert_float32_close(ours, *reference_logits(model, prompt))


@pytest.mark.parametrize("metadata, pattern", [
    ({"qwen35.nextn_predict_layers": (5, V.UINT32)},
     r"qwen35\.nextn_predict_layers = 5 leaves no layer of qwen35\.block_count = 5"),
    ({"qwen35.attention.recurrent_layers": ([True, False], V.ARRAY)},
     r"qwen35\.attention\.recurrent_layers must mark each of the 4 layers recurrent or not"),
    ({"qwen35.ssm.inner_size": (62, V.UINT32)},
     r"qwen35\.ssm\.inner_size = 62 is not a multiple of qwen35\.ssm\.time_step_rank = 4"),
    ({"qwen35.attention.recurrent_layers": None, "qwen35.full_attention_interval": (2, V.UINT32)},
     r"missing tensor blk\.1\.attn_output\.weight \(\+5 more\); qwen35\.block_count and the architecture"),
])
def test_hybrid_metadata_that_disagrees_with_the_tensors(tmp_path, metadata, pattern):
    path = rewritten(gguf_file("qwen35"), tmp_path / "bad.gguf", float_tensors(gguf_file("qwen35")), metadata)
    with pytest.raises(GGUFError, match=pattern):
        converted_dir(path)
