"""The quantized blocks of a GGUF file, mapped onto the model's (fused) projections as they are.

llama.cpp's converter permutes the rows of a Llama-architecture GGUF's attn_q / attn_k weights
(interleaved rotary halves); the inverse permutation of transformers' GGUF loader is applied to the
block rows here, which is exact because quantization never crosses a row. A projection whose GGUF
tensors are not all of one block type with a kernel (Q8_0, Q4_0, Q4_1) is left out, with its reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.weights import qkv_rows
from pdserve.kernels.quant_formats import GGUF_BLOCK_BYTES, QuantizedWeight, concat_rows, from_gguf_blocks

PERMUTED_QK_ARCHITECTURES = ("llama", "smollm3")
FUSED_ARCHITECTURES = ("phi3",)          # attn_qkv and ffn_up (gate and up) as one tensor each


class GGUFBlockError(ValueError):
    """A GGUF file whose tensors do not fit the model."""


@dataclass(frozen=True, slots=True)
class GGUFProjections:
    weights: dict[str, QuantizedWeight]                            # module name -> quantized weight
    skipped: dict[str, str] = field(default_factory=dict)          # module name -> why it stays dense


def read_gguf_projections(path: str | Path, config: ModelConfig, tied_head: bool) -> GGUFProjections:
    """Every projection of `config`'s model found in the GGUF at `path`, keyed by module name
    (`layers.0.self_attn.qkv_proj`, ..., `lm_head`); the head comes from token_embd when `tied_head`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    permute = _architecture(reader) in PERMUTED_QK_ARCHITECTURES
    fused = _architecture(reader) in FUSED_ARCHITECTURES
    weights, skipped = {}, {}
    for module, sources in _projection_sources(config, tied_head, fused).items():
        found = [_read(tensors, name, path) for name in sources]
        kinds = {kind for kind, _ in found}
        if len(kinds) != 1 or next(iter(kinds)) not in GGUF_BLOCK_BYTES:
            skipped[module] = f"{'/'.join(sources)}: {'+'.join(sorted(kinds))}"
            continue
        parts = [from_gguf_blocks(raw, kind) for kind, raw in found]
        if permute and module.endswith("qkv_proj"):
            parts[0] = parts[0].rows(unpermute_rows(parts[0].shape[0], config.num_heads))
            parts[1] = parts[1].rows(unpermute_rows(parts[1].shape[0], config.num_kv_heads))
        weights[module] = _in_model_order(concat_rows(parts), module, config)
    return GGUFProjections(weights, skipped)


def _in_model_order(weight: QuantizedWeight, module: str, config: ModelConfig) -> QuantizedWeight:
    """A qkv projection's rows in the order the model stores them (partial rotary: weights.qkv_rows)."""
    if not module.endswith("qkv_proj"):
        return weight
    rows = qkv_rows(config, int(module.split(".")[1]))
    return weight if rows is None else weight.rows(rows)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Index of the GGUF row that holds each Hugging Face row of a permuted q/k projection."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def _projection_sources(config: ModelConfig, tied_head: bool, fused: bool) -> dict[str, list[str]]:
    sources = {}
    for i in range(config.num_layers):
        blk, attn, mlp = f"blk.{i}", f"layers.{i}.self_attn", f"layers.{i}.mlp"
        sources[f"{attn}.qkv_proj"] = ([f"{blk}.attn_qkv.weight"] if fused else
                                       [f"{blk}.attn_q.weight", f"{blk}.attn_k.weight", f"{blk}.attn_v.weight"])
        sources[f"{attn}.o_proj"] = [f"{blk}.attn_output.weight"]
        if config.layer_kinds[i].experts:         # NOTE: stacked experts stay dense; a shared expert is a projection
            if config.experts.shared_intermediate_size:
                sources[f"{mlp}.shared_expert.gate_up_proj"] = [f"{blk}.ffn_gate_shexp.weight",
                                                                f"{blk}.ffn_up_shexp.weight"]
                sources[f"{mlp}.shared_expert.down_proj"] = [f"{blk}.ffn_down_shexp.weight"]
            continue
        sources[f"{mlp}.gate_up_proj"] = [f"{blk}.ffn_up.weight"] if fused else [f"{blk}.ffn_gate.weight",
                                                                                 f"{blk}.ffn_up.weight"]
        sources[f"{mlp}.down_proj"] = [f"{blk}.ffn_down.weight"]
    sources["lm_head"] = ["token_embd.weight" if tied_head else "output.weight"]
    return sources


def _read(tensors: dict, name: str, path: str | Path) -> tuple[str, torch.Tensor | None]:
    tensor = tensors.get(name)
    if tensor is None:
        raise GGUFBlockError(f"{path}: no tensor {name}")
    kind = tensor.tensor_type.name
    if kind not in GGUF_BLOCK_BYTES:
        return kind, None
    raw = torch.from_numpy(tensor.data.copy())                # raw: [rows, blocks * block_bytes] uint8
    rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
    if raw.dim() != 2 or raw.shape[0] != rows:
        raise GGUFBlockError(f"{path}: tensor {name} has {tuple(raw.shape)} bytes for {rows} rows")
    return kind, raw


def _architecture(reader) -> str:
    field_ = reader.fields.get("general.architecture")
    return "" if field_ is None else str(field_.contents())
