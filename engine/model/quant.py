"""Quantized weights where they pay: projections swapped for `QuantizedLinear` after loading.

Schemes: `int8` quantizes every projection's float weight per output channel (lossy: the dense
weight is replaced by its dequantization, so every batch size computes with the same weights); `gguf`
keeps the Q8_0 / Q4_0 / Q4_1 blocks of the GGUF file the model came from as they are (the dense
weights are those blocks dequantized, so nothing is lost); `auto` is `gguf` when the model has
such a file and the probe finds the kernel faster, else dense. Each swapped projection keeps its
dense weight for batches above the probe's crossover (prefill's large matmuls).
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
from pdserve.engine.model.gguf_block_cache import cached_gguf_projections
from pdserve.engine.model.gguf_blocks import GGUFBlockError
from pdserve.engine.model.layers import Linear
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.quant_probe import probe_bytes, probe_quantized
from pdserve.kernels.native_decode_layers import Projection
from pdserve.kernels.quant_formats import QuantizedWeight, dequantize, quantize_int8
from pdserve.kernels.quant_linear import KernelWeight, kernel_layout, native_available, quant_linear_native, supports

logger = logging.getLogger(__name__)

SCHEMES = ("none", "int8", "gguf", "auto")
CHECKED_ROWS = 16                # rows of each GGUF projection compared with the loaded weight


@dataclass(frozen=True, slots=True)
class QuantDecision:
    scheme: str                  # none | int8 | gguf: what the model now runs
    max_rows: int                # batches up to this many rows take the quantized kernel
    reason: str


class QuantizedLinear(nn.Module):
    """Drop-in for `Linear`: up to `max_rows` rows through the quantized kernel, more through `weight`."""

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


def quantize_model(model: CausalLM, scheme: str, gguf_path: Path | None, threads: int) -> QuantDecision:
    """Swap the projections that pay for QuantizedLinear; returns (and logs once) what was decided."""
    decision = _decide(model, scheme, gguf_path, threads)
    logger.info("quantization %s (batches <= %d rows): %s", decision.scheme, decision.max_rows, decision.reason)
    return decision


def _decide(model: CausalLM, scheme: str, gguf_path: Path | None, threads: int) -> QuantDecision:
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "none":
        return QuantDecision("none", 0, "not requested")
    if gguf_path is None and scheme != "int8":
        if scheme == "gguf":
            raise ValueError("--quantization gguf needs the model's GGUF file (--model FILE.gguf, "
                             "or one .gguf file in the model directory)")
        return QuantDecision("none", 0, "auto: no GGUF file (int8 changes the weights; "
                                        "ask for it with --quantization int8)")
    unavailable = _unavailable(model)
    if unavailable:
        return QuantDecision("none", 0, unavailable)
    if scheme == "int8":
        return _probe_and_swap(model, "int8", None, False, threads)
    try:
        packed = _gguf_weights(model, gguf_path)
    except (ValueError, OSError, ImportError) as e:          # NOTE: GGUFBlockError is a ValueError
        if scheme == "gguf":
            raise
        return QuantDecision("none", 0, f"auto: {e}")
    return _probe_and_swap(model, "gguf", packed, scheme == "auto", threads)


def _unavailable(model: CausalLM) -> str:
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"the quantized kernels run on CPU, the model is on {weight.device}"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"the quantized kernels take float32 or bfloat16 activations, not {weight.dtype}"
    if not native_available():
        return "the native kernel could not be built (no C compiler?)"
    return ""


def _gguf_weights(model: CausalLM, path: Path) -> dict[str, QuantizedWeight]:
    read = cached_gguf_projections(path, model.config, tied_head=model.lm_head is None)
    if read.skipped:
        shown = "; ".join(f"{name} ({why})" for name, why in list(read.skipped.items())[:3])
        logger.info("quantization gguf: %d projections stay dense, no kernel for their blocks: %s%s",
                    len(read.skipped), shown, " ..." if len(read.skipped) > 3 else "")
    dense = projections(model)
    for name, packed in read.weights.items():
        _check_matches(packed, dense[name].weight, name, path)
    return read.weights


def _check_matches(packed: QuantizedWeight, weight: torch.Tensor, name: str, path: Path) -> None:
    if tuple(packed.shape) != tuple(weight.shape):
        raise GGUFBlockError(f"{path}: {name} has shape {packed.shape}, the model's is {tuple(weight.shape)}")
    rows = torch.arange(min(CHECKED_ROWS, weight.shape[0]))
    expected, loaded = dequantize(packed.rows(rows)), weight[rows].float()
    if not torch.allclose(expected, loaded, rtol=2 ** -7, atol=1e-6):
        raise GGUFBlockError(f"{path}: {name} does not hold the model's loaded weights "
                             f"(max difference {(expected - loaded).abs().max().item():.3g})")


def _probe_and_swap(model: CausalLM, scheme: str, packed: dict[str, QuantizedWeight] | None, auto: bool,
                    threads: int) -> QuantDecision:
    dense = projections(model)
    names = _with_kernel(dense, packed, model.embed_tokens.weight.dtype)
    if not names:
        return QuantDecision("none", 0, f"{scheme}: no projection has a kernel")
    weights = packed or _LazyInt8(dense)
    tiled = {n: kernel_layout(weights[n]) for n in _probe_names(names, dense)}
    result = probe_quantized([dense[n].weight for n in tiled], list(tiled.values()), threads)
    if result.max_rows == 0 and auto:
        return QuantDecision("none", 0, f"auto: {scheme} kernel not faster here ({result.describe()})")
    max_rows = max(result.max_rows, 1)
    for name in names:
        if packed is None:
            with torch.no_grad():                   # NOTE: every batch size then sees the same weights
                dense[name].weight.copy_(dequantize(weights[name]))
        layout = tiled.get(name) or kernel_layout(weights[name])
        _swap(model, name, QuantizedLinear(dense[name].weight, dense[name].bias, layout, max_rows))
    streamed = sum(dense[n].weight.numel() * dense[n].weight.element_size() for n in tiled)
    return QuantDecision(scheme, max_rows, f"{len(names)} projections; probe on {next(iter(tiled))} "
                                           f"x{len(tiled)} ({streamed / 2**20:.0f} MiB) with {threads} threads: "
                                           f"{result.describe()}")


def _with_kernel(dense: dict[str, Linear], packed: dict[str, QuantizedWeight] | None,
                 dtype: torch.dtype) -> list[str]:
    """The projections the kernel takes (all of them for int8; those the GGUF has blocks for)."""
    if packed is None:
        return [n for n, m in dense.items() if supports("int8", m.weight.shape[1], dtype)]
    return [n for n in dense if n in packed and supports(packed[n].format, packed[n].shape[1], dtype)]


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
