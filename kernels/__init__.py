"""pdserve kernels: KV store, paged attention, RMSNorm, rotary, SiLU-and-mul and GeGLU, linear, MoE experts,
Gated DeltaNet's causal conv and delta rule.

Each function has a plain-torch reference (`<name>_ref`) beside its Triton version (`<name>_triton`,
used on CUDA tensors) and, for CPU tensors, a native C++ version (`<name>_native`, kernels/csrc,
built at first use by kernels/native.py). CPU tensors use the native kernels where they built and
the references otherwise. The environment variable PDSERVE_KERNELS=torch|triton forces one path
(torch: the references everywhere; triton on CPU needs TRITON_INTERPRET=1). Without Triton
installed CUDA tensors use the references, with a warning from `check_backend` at start-up for
CUDA devices; PDSERVE_KERNELS=triton is then an error.

A model runner chooses its `Backend` once, at load (`choose_backend`), and passes it to every op; an op
called without one (a test, a benchmark) chooses by its tensors on each call.
"""
from __future__ import annotations

import contextlib
import enum
import threading

import torch
import torch.nn.functional as F

from pdserve import env
from pdserve.kernels.native import cpu_kernels_enabled
from pdserve.kernels._triton import HAS_TRITON, INTERPRETED
from pdserve.kernels.activation import (
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from pdserve.kernels.backend import KernelBackendError, check_backend, triton_unusable_reason
from pdserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from pdserve.kernels.gated_delta import causal_conv1d_ref, gated_delta_rule_ref
from pdserve.kernels.gated_delta_triton import causal_conv1d_triton, gated_delta_rule_triton
from pdserve.kernels.grouped_gemm import moe_experts_triton
from pdserve.kernels.moe import moe_experts_ref
from pdserve.kernels.native_decode_attention import decode_attention_native
from pdserve.kernels.native_decode_attention import supports as native_attention_supports
from pdserve.kernels.native_decode_layers import DecodeLayers, Head, decode_layers_native
from pdserve.kernels.native_linear import linear_native, prefer_native
from pdserve.kernels.native_linear import supports as native_linear_supports
from pdserve.kernels.native_rms_norm import rms_norm_native
from pdserve.kernels.native_rotary_store import rotary_store_native
from pdserve.kernels.native_silu_and_mul import silu_and_mul_native
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from pdserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from pdserve.kernels.rotary import rotary_query_ref, rotary_query_triton, rotary_ref, rotary_triton
from pdserve.kernels.store_kv import store_kv_ref, store_kv_triton

__all__ = ["store_kv", "decode_attention", "prefill_attention", "rms_norm", "rotary", "rotary_query", "silu_and_mul",
           "rotary_store_kv", "linear", "gelu_tanh_and_mul", "decode_layers", "moe_experts", "causal_conv1d", "gated_delta_rule", "Backend",
           "choose_backend",
           "use_triton", "use_native", "check_backend", "KernelBackendError"]

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
MAX_TRITON_HEAD_DIM = 256


_INTERPRETER_LOCK = threading.Lock() if INTERPRETED else contextlib.nullcontext()
# NOTE: Triton's interpreter keeps the launch grid in globals: two actor threads must take turns.


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton path serves tensors like x (CUDA, or forced by PDSERVE_KERNELS)."""
    mode = env.kernels_override()
    if mode == "torch":
        return False
    if not HAS_TRITON:
        if mode == "triton":
            raise KernelBackendError(f"PDSERVE_KERNELS=triton: {triton_unusable_reason(x.device)}")
        return False
    return mode == "triton" or x.is_cuda


def use_native(x: torch.Tensor) -> bool:
    """True when the native C++ path serves tensors like x (CPU, float32/bfloat16, built, switched on,
    PDSERVE_KERNELS unset)."""
    return (x.device.type == "cpu" and x.dtype in NATIVE_DTYPES and not env.kernels_override()
            and cpu_kernels_enabled())


class Backend(enum.Enum):
    TORCH = "torch"      # the plain-torch references
    TRITON = "triton"    # CUDA tensors (or CPU ones under TRITON_INTERPRET=1)
    NATIVE = "native"    # CPU tensors through kernels/csrc, where an op has a native version (else torch)


def choose_backend(x: torch.Tensor) -> Backend:
    """The path ops on tensors like `x` take (device, dtype, PDSERVE_KERNELS, --cpu-kernels)."""
    if use_native(x):
        return Backend.NATIVE
    return Backend.TRITON if use_triton(x) else Backend.TORCH


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor, backend: Backend | None = None) -> None:
    """Write key/value [T, Hkv, D] into kv_pool [N, L, 2, bs, Hkv, D] at slots [T]; slot -1 skips."""
    if (backend or choose_backend(key)) is not Backend.TRITON:
        return store_kv_ref(key, value, kv_pool, layer, slot_mapping)
    with _INTERPRETER_LOCK:
        store_kv_triton(key, value, kv_pool, layer, slot_mapping)


def decode_attention(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, backend: Backend | None = None, *, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence, q [S, Hq, D], over its paged context; returns [S, Hq, D].

    context_lens [S] counts the current token, whose K/V must already be stored. window > 0: only the last
    `window` positions (a sliding-window layer); softcap > 0: scores capped at softcap * tanh(score / softcap);
    sinks [Hq]: a logit per head in the softmax denominator (attention sinks)."""
    backend = backend or choose_backend(q)
    options = dict(window=window, softcap=softcap, sinks=sinks)
    if backend is Backend.NATIVE and native_attention_supports(q, kv_pool):
        return decode_attention_native(q, kv_pool, layer, block_tables, context_lens, scale, **options)
    if backend is not Backend.TRITON or not triton_attention_supports(q):
        return decode_attention_ref(q, kv_pool, layer, block_tables, context_lens, scale, **options)
    with _INTERPRETER_LOCK:
        return decode_attention_triton(q, kv_pool, layer, block_tables, context_lens, scale, **options)


def prefill_attention(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      backend: Backend | None = None, *, window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a packed batch of new chunks q [T, Hq, D] over their paged context; [T, Hq, D].

    Sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1], the last positions of its
    context_lens[b] tokens (all K/V already stored). window, softcap, sinks: as decode_attention's."""
    backend = backend or choose_backend(q)
    options = dict(window=window, softcap=softcap, sinks=sinks)
    if backend is Backend.NATIVE and native_attention_supports(q, kv_pool):  # one-token rows: the native decode kernel
        return prefill_attention_ref(q, kv_pool, layer, cu_seqlens_q, context_lens, block_tables, scale,
                                     decode_rows=decode_attention_native, **options)
    if backend is not Backend.TRITON or not triton_attention_supports(q):
        return prefill_attention_ref(q, kv_pool, layer, cu_seqlens_q, context_lens, block_tables, scale, **options)
    with _INTERPRETER_LOCK:
        return prefill_attention_triton(q, kv_pool, layer, cu_seqlens_q, context_lens, block_tables, scale,
                                        **options)


def triton_attention_supports(q: torch.Tensor) -> bool:
    """The Triton attention kernels' tiles cover head sizes up to MAX_TRITON_HEAD_DIM (larger: the references)."""
    return q.shape[-1] <= MAX_TRITON_HEAD_DIM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             backend: Backend | None = None):
    """norm(x) * weight for x [T, H]; with residual returns (norm(x + residual) * weight, x + residual)."""
    backend = backend or choose_backend(x)
    if backend is Backend.NATIVE:
        return rms_norm_native(x, weight, eps, residual)
    if backend is Backend.TORCH:
        return rms_norm_ref(x, weight, eps, residual)
    with _INTERPRETER_LOCK:
        return rms_norm_triton(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor, backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D], k [T, Hkv, D]; cos_sin [P, D] = [cos | sin]; new (q, k)."""
    if (backend or choose_backend(q)) is not Backend.TRITON:
        return rotary_ref(q, k, positions, cos_sin)
    with _INTERPRETER_LOCK:
        return rotary_triton(q, k, positions, cos_sin)


def rotary_query(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 backend: Backend | None = None) -> torch.Tensor:
    """rotary() of q alone, for a layer that reads another layer's keys."""
    if (backend or choose_backend(q)) is not Backend.TRITON:
        return rotary_query_ref(q, positions, cos_sin)
    with _INTERPRETER_LOCK:
        return rotary_query_triton(q, positions, cos_sin)


def silu_and_mul(x: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I]."""
    backend = backend or choose_backend(x)
    if backend is Backend.NATIVE:
        return silu_and_mul_native(x)
    if backend is Backend.TORCH:
        return silu_and_mul_ref(x)
    with _INTERPRETER_LOCK:
        return silu_and_mul_triton(x)


def gelu_tanh_and_mul(x: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """gelu_tanh(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I] (no native version: the reference on CPU)."""
    if (backend or choose_backend(x)) is not Backend.TRITON:
        return gelu_tanh_and_mul_ref(x)
    with _INTERPRETER_LOCK:
        return gelu_tanh_and_mul_triton(x)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                    slot_mapping: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """rotary() then store_kv() of the rotated k and v; returns the rotated q (one fused pass on CPU)."""
    backend = backend or choose_backend(q)
    if backend is Backend.NATIVE:
        return rotary_store_native(q, k, v, positions, cos_sin, kv_pool, layer, slot_mapping)
    q, k = rotary(q, k, positions, cos_sin, backend)
    store_kv(k, v, kv_pool, layer, slot_mapping, backend)
    return q


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Backend | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T + bias [N]; the native kernel on CPU for batches it is faster at."""
    if ((backend or choose_backend(x)) is Backend.NATIVE and native_linear_supports(x, weight, bias)
            and prefer_native(x, weight)):
        return linear_native(x, weight, bias)
    return F.linear(x, weight, bias)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                backend: Backend | None = None) -> torch.Tensor:
    """A mixture-of-experts layer's experts over x [T, H]: each row's top-k experts (topk_ids [T, k]) weighted
    by topk_weights [T, k]; w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; returns [T, H]. Rows are
    grouped by expert and only the experts chosen are read (one grouped-GEMM launch per projection on Triton;
    per expert touched, this backend's linear, elsewhere)."""
    backend = backend or choose_backend(x)
    options = dict(activation=activation, alpha=alpha, limit=limit)
    if backend is Backend.TRITON:
        with _INTERPRETER_LOCK:
            return moe_experts_triton(x, w13, w2, topk_ids, topk_weights, b13, b2, **options)
    return moe_experts_ref(x, w13, w2, topk_ids, topk_weights, b13, b2, **options,
                           linear=lambda a, w, b: linear(a, w, b, backend),
                           silu_and_mul=lambda a: silu_and_mul(a, backend))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, backend: Backend | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) of x [T, C] (weight [C, K]), each sequence continuing from its slot of conv_states
    [slots, C, K - 1] and leaving its last inputs there; cu_seqlens None: one token per sequence."""
    if (backend or choose_backend(x)) is not Backend.TRITON:
        return causal_conv1d_ref(x, weight, conv_states, slots, cu_seqlens)
    with _INTERPRETER_LOCK:
        return causal_conv1d_triton(x, weight, conv_states, slots, cu_seqlens)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                     backend: Backend | None = None) -> torch.Tensor:
    """The gated delta rule over each sequence from its slot of states [slots, Hv, Dk, Dv] (updated in place):
    o [T, Hv, Dv]; the reference runs a prefill chunk chunked, Triton steps through it token by token; decode
    (cu_seqlens None) steps once."""
    if (backend or choose_backend(v)) is not Backend.TRITON:
        return gated_delta_rule_ref(q, k, v, g, beta, states, slots, cu_seqlens)
    with _INTERPRETER_LOCK:
        return gated_delta_rule_triton(q, k, v, g, beta, states, slots, cu_seqlens)


def decode_layers(layers: DecodeLayers, h: torch.Tensor, kv_pool: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, cos_sin: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, head: Head | None = None):
    """Every decoder layer of a decode step over h [S, hidden] in one native call (CPU; the caller
    checks `use_native` and `layers.serves`); returns (last layer's output, residual sum), or with `head`
    (checked by the caller: `head.serves`) the logits [S, head rows] float32."""
    return decode_layers_native(layers, h, kv_pool, positions, slot_mapping, cos_sin, block_tables, context_lens,
                                head)
