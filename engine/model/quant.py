"""Quantized weights: the model's checkpoint loaded with a quantization scheme (`load_weights_quantized`).

Schemes: `gguf` computes from the blocks of the GGUF file the model came from, as they are (every block
type with a kernel, kernels/gguf_formats.py): those projections and the embedding are swapped for
modules holding the mapped blocks before the checkpoint is read, so no float copy of them is ever
made (quant_gguf.py); `auto` is `gguf` where the model has such a file, else dense; `int8` quantizes
every projection's float weight per output channel after loading (lossy: the dense weight is replaced
by its dequantization, kept for batches above the probe's crossover, so every batch size computes
with the same weights).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pdserve import kernels

from pdserve.engine.model.gguf import SOURCE_FILE
from pdserve.engine.model.layers import Linear
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.quant_gguf import hold_gguf_blocks
from pdserve.engine.model.quant_probe import probe_bytes, probe_quantized
from pdserve.engine.model.weights import load_weights
from pdserve.kernels.gguf_linear import native_available as gguf_available
from pdserve.kernels.native_decode_layers import Projection
from pdserve.kernels.quant_formats import QuantizedWeight, dequantize, quantize_int8
from pdserve.kernels.quant_linear import KernelWeight, kernel_layout, native_available, quant_linear_native, supports

logger = logging.getLogger(__name__)

SCHEMES = ("none", "int8", "gguf", "auto")


@dataclass(frozen=True, slots=True)
class QuantDecision:
    scheme: str                  # none | int8 | gguf: what the model now runs
    max_rows: int                # batches up to this many rows take the quantized kernel (gguf: the blocks)
    reason: str


class QuantizedLinear(nn.Module):
    """Drop-in for `Linear` (int8): up to `max_rows` rows through the quantized kernel, more through `weight`."""

    backend: kernels.Backend | None = None

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, packed: KernelWeight,
                 max_rows: int) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = packed
        self.max_rows = max_rows

    def native_projection(self) -> Projection:
        """This linear as the one-call decode step runs it: the blocks up to max_rows, like forward."""
        return Projection(self.weight.data, None if self.bias is None else self.bias.data, self.packed, self.max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return kernels.linear(x, self.weight, self.bias, self.backend)
        y = quant_linear_native(x.contiguous(), self.packed)
        return y if self.bias is None else y.add_(self.bias)


def projections(model: CausalLM) -> dict[str, Linear]:
    """The model's projections by module name; a tied head is a Linear over the embedding."""
    found = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if model.lm_head is None:
        head = Linear.__new__(Linear)
        nn.Module.__init__(head)
        head.weight, head.bias = model.embed_tokens.weight, None
        found["lm_head"] = head
    return found


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file the model came from: the file a converted GGUF's gguf_source.json names, or
    the one .gguf in the directory; None when there is none (or it has gone)."""
    record = Path(model_dir) / SOURCE_FILE
    if record.is_file():
        path = Path(json.loads(record.read_text())["gguf_file"])
        return path if path.is_file() else None
    found = sorted(Path(model_dir).glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def load_weights_quantized(model: CausalLM, scheme: str, threads: int) -> QuantDecision:
    """Fill `model` (built with empty parameters) from its checkpoint under `scheme`: GGUF blocks taken
    before the checkpoint is read, so the float values of what they hold are never loaded; int8 after.
    Returns (and logs once) what was decided."""
    decision, skip = _hold(model, scheme, gguf_source(model.config.model_dir), threads)
    load_weights(model, model.config.model_dir, skip=skip)
    if scheme == "int8":
        decision = _int8(model, threads)
    if scheme != "none":
        _log(decision)
    return decision


def quantize_model(model: CausalLM, scheme: str, gguf_path: Path | None, threads: int) -> QuantDecision:
    """`scheme` applied to a loaded model (the float weights of what GGUF blocks replace are dropped);
    returns (and logs once) what was decided."""
    decision = _int8(model, threads) if scheme == "int8" else _hold(model, scheme, gguf_path, threads)[0]
    _log(decision)
    return decision


def _log(decision: QuantDecision) -> None:
    if decision.scheme == "gguf":
        logger.info("quantization gguf (CPU: from the blocks up to %d rows, dequantized tiles above): %s",
                    decision.max_rows, decision.reason)
    else:
        logger.info("quantization %s (batches <= %d rows): %s", decision.scheme, decision.max_rows, decision.reason)


def _hold(model: CausalLM, scheme: str, gguf_path: Path | None, threads: int) -> tuple[QuantDecision, frozenset]:
    """GGUF blocks swapped in where `scheme` asks for them: (decision, parameters the loader must skip)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme in ("none", "int8"):
        return QuantDecision("none", 0, "not requested"), frozenset()
    if gguf_path is None:
        if scheme == "gguf":
            raise ValueError("--quantization gguf needs the model's GGUF file (--model FILE.gguf, "
                             "or one .gguf file in the model directory)")
        return QuantDecision("none", 0, "auto: no GGUF file (int8 changes the weights; "
                                        "ask for it with --quantization int8)"), frozenset()
    unavailable = _gguf_unavailable(model)
    if unavailable:
        return QuantDecision("none", 0, unavailable), frozenset()
    try:
        held = hold_gguf_blocks(model, gguf_path, threads)
    except (ValueError, OSError, ImportError) as e:          # NOTE: GGUFBlockError is a ValueError
        if scheme == "gguf":
            raise
        return QuantDecision("none", 0, f"auto: {e}"), frozenset()
    if not held.skip:
        return QuantDecision("none", 0, f"{scheme}: no tensor has a kernel for its blocks ({held.report})"), frozenset()
    return QuantDecision("gguf", held.max_rows, held.report), held.skip


def _int8(model: CausalLM, threads: int) -> QuantDecision:
    unavailable = _unavailable(model, native_available)
    return QuantDecision("none", 0, unavailable) if unavailable else _probe_and_swap(model, threads)


def _gguf_unavailable(model: CausalLM) -> str:
    """Why GGUF blocks cannot serve this model ('' when they can): CPU through the native kernels, CUDA
    through the Triton ones."""
    weight = model.embed_tokens.weight
    if weight.device.type == "cuda":
        return "" if kernels.use_triton(weight) else "the GGUF kernels on CUDA need triton"
    return _unavailable(model, gguf_available)


def _unavailable(model: CausalLM, built) -> str:
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"the quantized kernels run on CPU, the model is on {weight.device}"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"the quantized kernels take float32 or bfloat16 activations, not {weight.dtype}"
    if not built():
        return "the native kernel could not be built (no C compiler?)"
    return ""


def _probe_and_swap(model: CausalLM, threads: int) -> QuantDecision:
    """int8: every projection quantized per output channel, its dense weight replaced by the dequantization."""
    dense = projections(model)
    dtype = model.embed_tokens.weight.dtype
    names = [n for n, m in dense.items() if supports("int8", m.weight.shape[1], dtype)]
    if not names:
        return QuantDecision("none", 0, "int8: no projection has a kernel")
    weights = _LazyInt8(dense)
    tiled = {n: kernel_layout(weights[n]) for n in _probe_names(names, dense)}
    result = probe_quantized([dense[n].weight for n in tiled], list(tiled.values()), threads)
    max_rows = max(result.max_rows, 1)
    for name in names:
        with torch.no_grad():                       # NOTE: every batch size then sees the same weights
            dense[name].weight.copy_(dequantize(weights[name]))
        layout = tiled.get(name) or kernel_layout(weights[name])
        _swap(model, name, QuantizedLinear(dense[name].weight, dense[name].bias, layout, max_rows))
    streamed = sum(dense[n].weight.numel() * dense[n].weight.element_size() for n in tiled)
    return QuantDecision("int8", max_rows, f"{len(names)} projections; probe on {next(iter(tiled))} "
                                           f"x{len(tiled)} ({streamed / 2**20:.0f} MiB) with {threads} threads: "
                                           f"{result.describe()}")


class _LazyInt8(dict):
    """name -> int8 quantization of that projection, computed once on first use."""

    def __init__(self, dense: dict[str, Linear]) -> None:
        super().__init__()
        self.dense = dense

    def __missing__(self, name: str) -> QuantizedWeight:
        self[name] = quantize_int8(self.dense[name].weight)
        return self[name]


def _probe_names(names: list[str], dense: dict[str, Linear], streamed: int | None = None) -> list[str]:
    """The largest per-layer projection, over as many layers as make `streamed` bytes of dense weights
    (`probe_bytes()`: more than the CPU's cache), or all of them."""
    layered = [n for n in names if n != "lm_head"] or names
    suffix = max(layered, key=lambda n: dense[n].weight.numel()).rsplit(".", 1)[-1]
    same = [n for n in layered if n.endswith(suffix)]
    per = dense[same[0]].weight.numel() * dense[same[0]].weight.element_size()
    return same[:max(1, (streamed or probe_bytes()) // per)]


def _swap(model: CausalLM, name: str, module: QuantizedLinear) -> None:
    model.forget_native_decode_layers()
    if name == "lm_head":
        model.lm_head = module
    else:
        model.set_submodule(name, module)
