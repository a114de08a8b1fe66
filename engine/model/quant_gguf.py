"""GGUF blocks held by the model's modules in place of float weights (`--quantization gguf`, and `auto`).

`hold_gguf_blocks` swaps every projection whose GGUF tensors have kernels for a `GGUFLinear`, and the
embedding (with a tied head) for a `GGUFEmbedding`, before the checkpoint is read: those weights are
never loaded as floats, and the loader is told which parameters to leave out. The blocks come from the
mapped block cache; a few rows of each are checked against the checkpoint (a GGUF of another model is
refused). A probe sets the batch up to which the block kernels beat dequantized tiles. One log line
reports, per GGUF tensor type, what runs from blocks and what does not.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model.gguf_block_cache import CachedBlocks, cached_gguf_blocks
from pdserve.engine.model.gguf_blocks import EMBEDDING, GGUFBlockError
from pdserve.engine.model.gguf_modules import GGUFEmbedding, GGUFLinear
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.probe_store import ProbeStore, probe_key
from pdserve.engine.model.quant_probe import probe_blocks, probe_bytes
from pdserve.engine.model.weights import checkpoint_files, destinations
from pdserve.kernels.gguf_formats import GGUFMatrix
from pdserve.kernels.gguf_linear import gguf_gather

CHECKED_ROWS = 16                # rows of each tensor compared with the checkpoint


@dataclass(frozen=True, slots=True)
class Held:
    max_rows: int                # batches up to this many rows compute from the blocks, larger ones from tiles
    skip: frozenset[str]         # parameters the checkpoint must not fill (their modules hold blocks)
    report: str


def hold_gguf_blocks(model: CausalLM, path: Path, threads: int) -> Held:
    """Swap the modules whose GGUF tensors have kernels; raises GGUFBlockError for a GGUF that does not
    hold the model's weights, ValueError / OSError for one that cannot be read."""
    blocks = cached_gguf_blocks(path, model.config, tied_head=model.lm_head is None)
    device = model.embed_tokens.weight.device
    matrices = _on_device(blocks, device)
    if not matrices:
        return Held(0, frozenset(), describe(blocks, set()))
    _check_against_checkpoint(model, matrices, path)
    matrices = {n: m.to(device) for n, m in matrices.items()}
    dtype = model.embed_tokens.weight.dtype
    skip = set()
    for name, matrix in matrices.items():
        skip.add(f"{name}.weight")
        if name == EMBEDDING:
            model.embed_tokens = GGUFEmbedding(matrix, dtype, model.embed_tokens.weight.device)
            if model.lm_head is None:
                model.lm_head = GGUFLinear(matrix, None)
                skip.add("lm_head.weight")
        else:
            model.set_submodule(name, GGUFLinear(matrix, model.get_submodule(name).bias))
    model.forget_native_decode_layers()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    max_rows, probed = _probe(linears, dtype, threads, path) if linears and device.type == "cpu" else \
        (0, f"On {device}: every batch through the Triton kernels")
    for module in linears.values():
        module.max_rows = max_rows
    return Held(max_rows, frozenset(skip), f"{describe(blocks, set(matrices))}. {probed}")


def _on_device(blocks: CachedBlocks, device: torch.device) -> dict[str, GGUFMatrix]:
    """The modules held in blocks on `device`: every one on CPU; on CUDA those without an F32 / F16 / BF16
    part (the Triton kernels decode quantized blocks only)."""
    if device.type == "cpu":
        return dict(blocks.matrices)
    return {n: m for n, m in blocks.matrices.items() if not set(m.types) & {"F32", "F16", "BF16"}}


def _probe(linears: dict[str, GGUFLinear], dtype: torch.dtype, threads: int, path: Path) -> tuple[int, str]:
    """The largest batch at which the block kernels beat tiles (at least 1), and what was timed: as many
    layers of the largest per-layer projection as stream `probe_bytes()` (every layer where there are fewer);
    the answer an earlier start kept for the same inputs where there is one (`probe_store`)."""
    layered = {n: m.matrix for n, m in linears.items() if n != "lm_head"} or {n: m.matrix for n, m in linears.items()}
    largest = max(layered, key=lambda n: layered[n].nbytes)
    suffix = largest.rsplit(".", 1)[-1]
    same = [m for n, m in layered.items() if n.endswith(suffix)]
    streamed = probe_bytes()
    count = max(1, streamed // layered[largest].nbytes)
    store = ProbeStore(probe_key(path, dtype, threads, f"{suffix} x{len(same[:count])}", streamed))
    kept = store.load()
    if kept is not None:
        return kept[0], f"{kept[1]} (kept from an earlier start: {store.path})"
    result = probe_blocks(same[:count], dtype, threads)
    max_rows, report = max(result.max_rows, 1), (f"Probe on {suffix} x{len(same[:count])} with {threads} threads: "
                                                 f"{result.describe('tiles', 'blocks')}")
    store.save(max_rows, report)
    return max_rows, report


def describe(blocks: CachedBlocks, held: set[str]) -> str:
    """Per GGUF tensor type: how many tensors run from blocks (the `held` modules'; the embedding's rows are
    gathered from them) and how many do not (1-D norms and biases, which are float, and the modules left
    dense, named)."""
    in_blocks = {n for module in held for n in blocks.names[module]}
    counts = Counter((kind, name in in_blocks) for name, kind in blocks.types.items())
    parts = []
    for kind in sorted({k for k, _ in counts}):
        blocks_n, other = counts[(kind, True)], counts[(kind, False)]
        text = f"{kind}: {blocks_n} from blocks" if blocks_n else f"{kind}:"
        if other:
            text += f"{',' if blocks_n else ''} {other} not from blocks"
        parts.append(text)
    skipped = {**blocks.skipped, **{m: "+".join(blocks.matrices[m].types) for m in blocks.matrices if m not in held}}
    dense = "; ".join(f"{m} ({why})" for m, why in list(skipped.items())[:3])
    more = f" (+{len(skipped) - 3} more)" if len(skipped) > 3 else ""
    return "; ".join(parts) + (f". Dense (no kernel for their types here): {dense}{more}" if skipped else "")


def _check_against_checkpoint(model: CausalLM, matrices: dict[str, GGUFMatrix], path: Path) -> None:
    """The first rows of every part equal the checkpoint's (the float values the model would load)."""
    files = checkpoint_files(Path(model.config.model_dir))
    by_param: dict[str, list] = {}
    fused = "model.layers.0.self_attn.qkv_proj.weight" in files
    for name, dest in destinations(model, fused=fused).items():
        by_param.setdefault(dest.param, []).append((dest.start or 0, name, dest.rows))
    for module, matrix in matrices.items():
        parts = sorted(by_param.get(f"{module}.weight", []), key=lambda part: part[0])
        if len(parts) != len(matrix.segments):
            raise GGUFBlockError(f"{path}: {module} has {len(matrix.segments)} parts, the model {len(parts)}")
        for (_, name, order), segment in zip(parts, matrix.segments):
            count = min(CHECKED_ROWS, segment.rows)
            with safe_open(files[name], framework="pt") as f:
                rows = f.get_slice(files.stored[name])
                expected = (rows[:count] if order is None else
                            torch.cat([rows[int(r):int(r) + 1] for r in order[:count]])).float()
            if tuple(expected.shape) != (count, segment.in_features):
                raise GGUFBlockError(f"{path}: {module} holds rows of {segment.in_features}, the model's "
                                     f"{name} {tuple(expected.shape)}")
            loaded = gguf_gather(segment, torch.arange(count), torch.float32)
            if not torch.allclose(loaded, expected, rtol=2 ** -7, atol=1e-6):
                raise GGUFBlockError(f"{path}: {module} does not hold the model's loaded weights "
                                     f"(max difference {(loaded - expected).abs().max().item():.3g})")
