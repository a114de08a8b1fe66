"""A GGUF file's tensors as Hugging Face safetensors: checked, dequantized, un-permuted, sharded.

Each tensor is stored in the narrowest dtype that holds its values exactly: F32, F16 and BF16
tensors as they are, quantized ones dequantized (by `gguf.quants`) to float32 -- a quantized
value is an fp16 scale times a small integer (plus an fp16 offset), which fp16 or bf16 would round.
So a float32 load reproduces transformers' float32 load of the same file bit for bit. A tensor the converter
changed is changed back (`TensorSpec.undo`): reordered rows exactly, Qwen3-Next's A = -exp(A_log) to within
float32 rounding.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from pdserve.engine.model.gguf_config import FOLDED
from pdserve.engine.model.gguf_specs import TensorSpec
from pdserve.engine.model.gguf_reader import GGUFFile

Q = gguf.GGMLQuantizationType
SHARD_BYTES = 256 << 20        # NOTE: bounds the memory of a conversion, and the mapped pages of a load, to ~one shard
IGNORED = frozenset(FOLDED)     # folded into config.json's rope_scaling


def check_tensors(f: GGUFFile, specs: dict[str, TensorSpec], block_key: str, layers: int) -> None:
    """GGUFError naming the tensor for one that is missing, unexpected, mis-shaped or of an unusable type.
    The blocks of `block_key` after the first `layers` (multi-token prediction's) are not served: their tensors
    are ignored."""
    missing = [n for n in specs if n not in f.tensors]
    if missing:
        raise f.error(f"missing tensor {missing[0]}{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}"
                      f"; {block_key} and the architecture call for it")
    unserved = range(layers, f.integer(block_key))
    extra = [n for n in f.tensors if n not in specs and n not in IGNORED and _block(n) not in unserved]
    if extra:
        raise f.error(f"unexpected tensor {extra[0]} for {f.architecture} with {block_key} = "
                      f"{f.integer(block_key)}{f' (+{len(extra) - 1} more)' if len(extra) > 1 else ''}")
    for name, spec in specs.items():
        shape = logical_shape(f.tensors[name])
        if _outer_ones_dropped(shape) != _outer_ones_dropped(spec.shape):
            raise f.error(f"tensor {name} has shape {shape}, but {spec.keys} make it {spec.shape}")
        if not can_dequantize(f.tensors[name].tensor_type):
            raise f.error(f"tensor {name} has type {f.tensors[name].tensor_type.name}, which the gguf "
                          f"package cannot dequantize")


def _outer_ones_dropped(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape without its outer dimensions of 1, which llama-quantize drops (a shared expert's gate: (1, hidden))."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _block(name: str) -> int | None:
    block = name.split(".")[1] if name.startswith("blk.") else ""
    return int(block) if block.isdecimal() else None


def converted_tensors(f: GGUFFile, specs: dict[str, TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every spec, in file order, values exactly as stored but where the spec
    undoes a change of the converter's; stacked experts split one per expert, or the parts of a tensor
    (gpt-oss's interleaved gate_up_proj, Qwen3-Next's in_proj_qkvz) joined once all are read."""
    parts: dict[str, list[torch.Tensor | None]] = {}
    for name, spec in specs.items():
        tensor = dequantized(f.tensors[name]).reshape(spec.shape)
        if spec.unpermute_heads:
            tensor = unpermute(tensor, spec.unpermute_heads)
        if spec.offset:
            tensor = (tensor.float() - spec.offset).to(tensor.dtype)     # NOTE: exact: 1 + w is within 2x of 1
        if spec.transposed:
            tensor = tensor.transpose(-1, -2)
        index, count = spec.part
        if count > 1:
            joined = parts.setdefault(spec.hf_name, [None] * count)
            joined[index] = tensor
            if any(p is None for p in joined):
                continue
            tensor = (torch.cat(parts.pop(spec.hf_name)) if spec.concatenated else
                      torch.stack(parts.pop(spec.hf_name), dim=-1).flatten(-2))    # every count-th column
        for step in spec.undo:
            tensor = step(tensor)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise f.error(f"tensor {name} holds non-finite values: the file is corrupt")
        if spec.experts:
            yield from ((spec.hf_name.format(expert=e), t.contiguous()) for e, t in enumerate(tensor))
        else:
            yield spec.hf_name, tensor.contiguous()


def dequantized(t) -> torch.Tensor:
    """A reader tensor's values, as float32 unless it is stored as F16/BF16 (kept exact)."""
    raw = np.ascontiguousarray(t.data)
    if t.tensor_type == Q.F32:
        return torch.from_numpy(raw.view(np.float32).copy())
    if t.tensor_type == Q.F16:
        return torch.from_numpy(raw.view(np.float16).copy())
    if t.tensor_type == Q.BF16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type))


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows: per head, interleaved (x0, y0, x1, y1, ...) back to halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def logical_shape(t) -> tuple[int, ...]:
    """A reader tensor's shape in row-major order ([out, in]); GGUF lists dimensions innermost first."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def can_dequantize(kind: gguf.GGMLQuantizationType) -> bool:
    if kind in (Q.I8, Q.I16, Q.I32, Q.I64, Q.F64):
        return False
    if kind in (Q.F32, Q.F16, Q.BF16):
        return True
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards of ~SHARD_BYTES with their index."""
    shard, size, shards = {}, 0, []
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            shards.append(_save_shard(shard, out_dir, len(shards)))
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    shards.append(_save_shard(shard, out_dir, len(shards)))
    _name_shards(shards, out_dir)


def _save_shard(shard: dict[str, torch.Tensor], out_dir: Path, index: int) -> list[str]:
    save_file(shard, out_dir / f"shard-{index:05d}.safetensors", metadata={"format": "pt"})
    return list(shard)


def _name_shards(shards: list[list[str]], out_dir: Path) -> None:
    if len(shards) == 1:
        (out_dir / "shard-00000.safetensors").rename(out_dir / "model.safetensors")
        return
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        (out_dir / f"shard-{i:05d}.safetensors").rename(out_dir / name)
    weight_map = {tensor: names[i] for i, shard in enumerate(shards) for tensor in shard}
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
