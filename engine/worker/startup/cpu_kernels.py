"""`--cpu-kernels` at start-up: the C++ CPU kernels (kernels/csrc, built by kernels/native.py) or the
plain-torch references, decided before the engine reports ready.

`native` builds them (or loads the build cached under $PDSERVE_CACHE/kernels/); `torch` keeps the
references; `auto` (the default) builds them and keeps them where a start-up probe, on this CPU with
the model's shapes and the serving thread count, finds one decode layer's element-wise and attention
work (RMSNorm + residual, rotary + KV store, paged attention, SiLU-and-mul) no slower than the
references'. Where the native attention cannot take the model's heads (a head size that is not a
multiple of 16), both sides of the probe run the reference attention, as the model then would.
Linears are chosen per shape and batch by kernels/native_linear.py's own measurement either way. A
failed build logs one line (kernels/native.py) and the references serve; a probe never fails a start.
"""
from __future__ import annotations

import logging
import time

import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.worker.startup.defaults import Choice, ProbeResult, probe
from pdserve.kernels import native
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.native_decode_attention import decode_attention_native
from pdserve.kernels.native_decode_attention import supports as attention_supports
from pdserve.kernels.native_rms_norm import rms_norm_native
from pdserve.kernels.native_rotary_store import rotary_store_native, rotary_store_ref
from pdserve.kernels.native_silu_and_mul import silu_and_mul_native
from pdserve.kernels.rms_norm import rms_norm_ref

logger = logging.getLogger(__name__)

CPU_KERNELS = ("auto", "native", "torch")
PROBE_SEQS, PROBE_CONTEXT, PROBE_BLOCK = 8, 512, 16    # a decode step of 8 sequences, 512 tokens each
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def prepare_cpu_kernels(choice: str, model: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
                        threads: int = 1) -> Choice:
    """Apply --cpu-kernels for this process; returns (and logs) what serves CPU tensors and why.

    Raises ValueError for an unknown choice."""
    if choice not in CPU_KERNELS:
        raise ValueError(f"--cpu-kernels must be one of {', '.join(CPU_KERNELS)}, got {choice!r}")
    decision = _decide(choice, model, dtype, threads)
    native.set_cpu_kernels(decision.value == "native")
    logger.info("%s", decision)
    return decision


def _decide(choice: str, model: ModelConfig | None, dtype: torch.dtype, threads: int) -> Choice:
    if choice == "torch":
        return Choice("cpu-kernels", "torch", "asked for (--cpu-kernels torch)")
    started = time.perf_counter()
    if native.cpu_kernels() is None:
        return Choice("cpu-kernels", "torch", "the native kernels could not be built (see above)")
    built = f"built or loaded in {time.perf_counter() - started:.1f} s"
    if choice == "native" or model is None:
        return Choice("cpu-kernels", "native", f"{built}, asked for (--cpu-kernels native)")
    if dtype not in NATIVE_DTYPES:
        return Choice("cpu-kernels", "torch", f"auto: no native kernels for {dtype}")
    try:
        result = probe_layer_ops(model, dtype, threads)
    except Exception as e:  # NOTE: a probe informs a choice; it must never stop a start
        logger.warning("the native kernels' start-up probe failed (%s: %s); using the torch path", type(e).__name__, e)
        return Choice("cpu-kernels", "torch", f"auto: the probe failed ({type(e).__name__})")
    speedup = result.speedup("native", over="torch")
    value = "native" if speedup >= 1.0 else "torch"
    return Choice("cpu-kernels", value, f"auto: {built}; a decode layer's attention and element-wise ops "
                                        f"{_ratio(speedup)} than torch's with {threads} threads")


def _ratio(speedup: float) -> str:
    if speedup >= 1.0:
        return f"{speedup:.2f}x faster"
    return f"{1 / speedup:.2f}x slower" if speedup > 0.0 else "unmeasurably slower"


def probe_layer_ops(model: ModelConfig, dtype: torch.dtype, threads: int) -> ProbeResult:
    """Best time of one decode layer's non-linear ops, native against the references, on random data."""
    inputs = _probe_inputs(model, dtype)
    native_attention = attention_supports(inputs["q"], inputs["pool"])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return probe({"native": lambda: _layer_ops(inputs, native=True, native_attention=native_attention),
                      "torch": lambda: _layer_ops(inputs, native=False)})
    finally:
        torch.set_num_threads(previous)


def _probe_inputs(model: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs, heads, kv_heads, dim = PROBE_SEQS, model.num_heads, model.num_kv_heads, model.head_dim
    per_seq = PROBE_CONTEXT // PROBE_BLOCK
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)      # noqa: E731
    return {"h": rand(seqs, model.hidden_size), "residual": rand(seqs, model.hidden_size),
            "norm": rand(model.hidden_size), "gate_up": rand(seqs, 2 * model.intermediate_size),
            "q": rand(seqs, heads, dim), "k": rand(seqs, kv_heads, dim), "v": rand(seqs, kv_heads, dim),
            "pool": rand(seqs * per_seq, 1, 2, PROBE_BLOCK, kv_heads, dim),
            "tables": torch.randperm(seqs * per_seq, generator=g).to(torch.int32).view(seqs, per_seq),
            "lens": torch.full((seqs,), PROBE_CONTEXT, dtype=torch.int32),
            "positions": torch.full((seqs,), PROBE_CONTEXT - 1, dtype=torch.int32),
            "slots": torch.arange(seqs, dtype=torch.int32) * PROBE_CONTEXT + PROBE_CONTEXT - 1,
            "cos_sin": torch.rand(PROBE_CONTEXT, dim, generator=g)}


def _layer_ops(t: dict[str, torch.Tensor], native: bool, native_attention: bool = True) -> None:
    norm, rotary_store, attention, silu = ((rms_norm_native, rotary_store_native, decode_attention_native,
                                            silu_and_mul_native) if native else
                                           (rms_norm_ref, rotary_store_ref, decode_attention_ref, silu_and_mul_ref))
    if not native_attention:
        attention = decode_attention_ref
    norm(t["h"], t["norm"], 1e-5, t["residual"])
    q = rotary_store(t["q"], t["k"], t["v"], t["positions"], t["cos_sin"], t["pool"], 0, t["slots"])
    attention(q, t["pool"], 0, t["tables"], t["lens"], t["q"].shape[-1] ** -0.5)
    norm(t["h"], t["norm"], 1e-5, t["residual"])
    silu(t["gate_up"])
