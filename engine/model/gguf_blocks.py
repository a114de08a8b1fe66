"""The weight blocks of a GGUF file, by the model module they serve, as they lie in the file.

Each projection (`layers.0.self_attn.qkv_proj`, ..., `lm_head`) and the embedding (`embed_tokens`) maps
to its GGUF tensors (q, k, v; gate, up; one otherwise); each tensor is one segment of rows in its own
type. llama.cpp's converter permutes the rows of a Llama (and SmolLM3) GGUF's attn_q / attn_k weights
(interleaved rotary halves); the inverse permutation of transformers' GGUF loader is applied to their
block rows, which is exact because quantization never crosses a row, as is the model's own order of
q/k rows under a partial rotary and of a gated attention's queries and gates (weights.fused_qkv_rows).
Phi-3's attn_qkv and ffn_up are one tensor each. A module with a part of a type no kernel takes is left out,
with its reason; so are the Gated DeltaNet layers' projections (hybrid models), which load dequantized.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.weights import fused_qkv_rows
from pdserve.kernels.gguf_formats import QUANTIZED_TYPES, TYPES, row_bytes

PERMUTED_QK_ARCHITECTURES = ("llama", "smollm3")
FUSED_ARCHITECTURES = ("phi3",)          # attn_qkv and ffn_up (gate and up) as one tensor each
EMBEDDING = "embed_tokens"


class GGUFBlockError(ValueError):
    """A GGUF file whose tensors do not fit the model."""


@dataclass(frozen=True, slots=True)
class TensorBlocks:
    name: str                  # the GGUF tensor's name
    type: str                  # its type (a key of kernels.gguf_formats.TYPES)
    data: np.ndarray           # uint8 [rows, row bytes], rows in the model's (Hugging Face) order


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    modules: dict[str, list[TensorBlocks]]                       # module name -> its parts, in row order
    skipped: dict[str, str] = field(default_factory=dict)        # module name -> why it stays dense
    types: dict[str, str] = field(default_factory=dict)          # every GGUF tensor's name -> type


def module_sources(config: ModelConfig, tied_head: bool, fused: bool = False) -> dict[str, list[str]]:
    """Each module that can compute from blocks, and the GGUF tensors it is made of, in row order."""
    sources = {EMBEDDING: ["token_embd.weight"]}
    for i in range(config.num_layers):
        blk, attn, mlp = f"blk.{i}", f"layers.{i}.self_attn", f"layers.{i}.mlp"
        if not config.layer_kinds[i].recurrent:
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
    if not tied_head:
        sources["lm_head"] = ["output.weight"]
    return sources


def read_gguf_blocks(path: str | Path, config: ModelConfig, tied_head: bool) -> GGUFBlocks:
    """Every module of `config`'s model whose GGUF tensors have kernels, read from the file at `path`
    (memory-mapped: the arrays are views of the file until copied)."""
    from pdserve.engine.model.gguf_reader import GGUFMetadataReader

    reader = GGUFMetadataReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    permute = _architecture(reader) in PERMUTED_QK_ARCHITECTURES
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    modules, skipped = {}, {}
    for module, names in module_sources(config, tied_head, _architecture(reader) in FUSED_ARCHITECTURES).items():
        if any(name not in tensors for name in names):
            skipped[module] = f"{'/'.join(n for n in names if n not in tensors)}: not in the file"
            continue
        kinds = [tensors[name].tensor_type.name for name in names]
        if any(kind not in TYPES for kind in kinds) or not any(kind in QUANTIZED_TYPES for kind in kinds):
            skipped[module] = f"{'/'.join(names)}: {'+'.join(kinds)}"
            continue
        parts = []
        for name, kind in zip(names, kinds):
            data = _rows(tensors[name], kind, config.hidden_size if module == EMBEDDING else None, path)
            short = name.split(".")[-2]
            if permute and short in heads:
                data = data[unpermute_rows(data.shape[0], heads[short])]
            parts.append(TensorBlocks(name, kind, data))
        modules[module] = _in_model_order(parts, module, config)
    return GGUFBlocks(modules, skipped, {t.name: t.tensor_type.name for t in reader.tensors})


def _in_model_order(parts: list[TensorBlocks], module: str, config: ModelConfig) -> list[TensorBlocks]:
    """A q/k/v projection's rows in the order the model stores them (weights.fused_qkv_rows, which reorders rows
    within each of q and k only), each part keeping its own rows."""
    order = fused_qkv_rows(config, int(module.split(".")[1])) if module.endswith("qkv_proj") else None
    if order is None:
        return parts
    reordered, first = [], 0
    for part in parts:
        rows = order[first:first + part.data.shape[0]].numpy() - first
        if rows.min() < 0 or rows.max() >= part.data.shape[0]:
            raise GGUFBlockError(f"{part.name}: the model's q/k/v row order crosses its parts")
        reordered.append(TensorBlocks(part.name, part.type, part.data[rows]))
        first += part.data.shape[0]
    return reordered


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Index of the GGUF row that holds each Hugging Face row of a permuted q/k projection."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)


def _rows(tensor, kind: str, width: int | None, path: str | Path) -> np.ndarray:
    """The tensor's bytes as [rows, row bytes] (a view of the mapped file)."""
    shape = [int(n) for n in tensor.shape]                  # GGUF lists the innermost dimension first
    if len(shape) != 2 or (width is not None and shape[0] != width):
        raise GGUFBlockError(f"{path}: tensor {tensor.name} has shape {shape[::-1]}, not a matrix of rows "
                             f"{width or ''}")
    raw = np.asarray(tensor.data).view(np.uint8).reshape(shape[1], -1)
    if raw.shape[1] != row_bytes(kind, shape[0]):
        raise GGUFBlockError(f"{path}: tensor {tensor.name} has {raw.shape[1]} bytes a row for {shape[0]} "
                             f"{kind} weights")
    return raw


def _architecture(reader) -> str:
    field_ = reader.fields.get("general.architecture")
    return "" if field_ is None else str(field_.contents())
