"""y = x @ weight^T (+ bias) for a few rows of x (decode steps), in C++: kernels/csrc/linear.cpp.

Each thread streams its own contiguous share of the weight rows once, against every row of x; at
batch 1 that is a GEMV at the memory-bandwidth limit. The reference is F.linear (BLAS).

Which of the two is faster depends on the CPU, the dtype and the number of rows (oneDNN's bf16
GEMM on an AVX512-BF16 or AMX CPU wins from a few rows on; on AVX2 its bf16 path is slow
throughout), so `prefer_native` measures both once per (dtype, weight shape, power-of-two row
bucket, threads), on the thread that runs them, and remembers the winner; serving decides them all at
load over the weights as a step streams them (`warm_prefer_native`). Rows above
MAX_NATIVE_ROWS always go to BLAS: the tiles here are built for decode batches, not prefill.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdserve.kernels.native import INT, INT64, POINTER, SUFFIXES, bind
from pdserve.kernels.timing import best_seconds

logger = logging.getLogger(__name__)

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
MAX_NATIVE_ROWS = 64
TIMED_CALLS = 3

_winners: dict[tuple, bool] = {}


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@functools.cache
def _kernel(dtype: torch.dtype):
    return bind(f"pd_linear_{SUFFIXES[str(dtype)]}",
                        POINTER, INT64, POINTER, POINTER, POINTER, INT64, INT64, INT64, INT64, INT)


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N], in x's dtype, accumulated in float32."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    assert weight.shape == (out_features, in_features) and weight.is_contiguous()
    assert x.dtype == weight.dtype and x.dtype in NATIVE_DTYPES and x.stride(1) == 1
    assert bias is None or (bias.shape == (out_features,) and bias.dtype == x.dtype and bias.is_contiguous())
    assert x.device.type == weight.device.type == "cpu"
    out = torch.empty((rows, out_features), dtype=x.dtype)
    _kernel(x.dtype)(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                     out.data_ptr(), out_features, rows, out_features, in_features, torch.get_num_threads())
    return out


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True when linear_native takes these tensors as they are."""
    return (x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def prefer_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_native beats F.linear for x's row bucket and weight's shape (measured once)."""
    rows = x.shape[0]
    if rows > MAX_NATIVE_ROWS or rows == 0:
        return False
    key = (x.dtype, *weight.shape, row_bucket(rows), torch.get_num_threads())
    winner = _winners.get(key)
    if winner is None:
        winner = _winners[key] = _measure(x, weight, key)
    return winner


def row_bucket(rows: int) -> int:
    """The power of two at or above `rows`: the batches one decision covers."""
    return 1 << (rows - 1).bit_length()


def row_buckets() -> list[int]:
    """The power-of-two row counts `prefer_native` decides for: 1, 2, 4, ... MAX_NATIVE_ROWS."""
    return [1 << k for k in range(MAX_NATIVE_ROWS.bit_length())]


def warm_prefer_native(weights: list[torch.Tensor], thread_counts: tuple[int, ...], stream_bytes: int) -> int:
    """Decide `prefer_native` now, at load, for every weight shape, row bucket and thread count a step can
    run with (a lent core changes the count), instead of timing both kernels inside a serving step;
    returns how many decisions were made.

    One race per dtype, bucket and thread count, over the weights themselves in model order up to
    `stream_bytes` (every one where the model has less), so that they come from memory as in a step: timed
    on one weight, which then sits in cache, the race picked BLAS where a step streaming its weights runs
    faster natively, and those steps left the one-call native step (bench/RESULTS.md, "Measured once").
    A step runs every projection, so every shape of the dtype takes the race's winner."""
    groups: dict[torch.dtype, dict[int, torch.Tensor]] = {}
    for w in weights:
        if w.dim() == 2 and w.dtype in NATIVE_DTYPES and w.is_contiguous():
            groups.setdefault(w.dtype, {}).setdefault(w.data_ptr(), w)
    before, previous = len(_winners), torch.get_num_threads()
    try:
        for threads in sorted(set(thread_counts)):
            torch.set_num_threads(threads)
            for dtype, unique in groups.items():
                streamed = _streamed(list(unique.values()), stream_bytes)
                shapes = {tuple(w.shape) for w in unique.values()}
                for rows in row_buckets():
                    native, blas = race(streamed, rows)
                    logger.debug("linear %s x %d rows, %d threads, %d weights: native %.2f ms, BLAS %.2f ms",
                                 dtype, rows, threads, len(streamed), native * 1e3, blas * 1e3)
                    for shape in shapes:
                        _winners[(dtype, *shape, rows, threads)] = native <= blas
    finally:
        torch.set_num_threads(previous)
    return len(_winners) - before


def _streamed(weights: list[torch.Tensor], stream_bytes: int) -> list[torch.Tensor]:
    """The first weights whose bytes reach `stream_bytes` (all of them where they do not)."""
    taken, size = [], 0
    for w in weights:
        if size >= stream_bytes:
            break
        taken.append(w)
        size += w.numel() * w.element_size()
    return taken


def race(weights: list[torch.Tensor], rows: int) -> tuple[float, float]:
    """(native, BLAS) seconds of one pass of `rows` rows through every weight, the fastest of TIMED_CALLS
    passes each after a warm-up, the two taking turns."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    runs = (lambda: [linear_native(inputs[w.shape[1]], w) for w in weights],
            lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
    for run in runs:
        run()
    best = [float("inf")] * len(runs)
    for _ in range(TIMED_CALLS):
        for i, run in enumerate(runs):
            best[i] = min(best[i], best_seconds(run, 1))
    return best[0], best[1]


def _measure(x: torch.Tensor, weight: torch.Tensor, key: tuple) -> bool:
    native = best_seconds(lambda: linear_native(x, weight), TIMED_CALLS + 1)
    blas = best_seconds(lambda: F.linear(x, weight), TIMED_CALLS + 1)
    logger.debug("linear %s: native %.0f us, BLAS %.0f us", key, native * 1e6, blas * 1e6)
    return native <= blas
