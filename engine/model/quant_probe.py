"""Start-up probes: does the quantized kernel beat the dense matmul on this CPU, and up to what batch?
For GGUF blocks: up to what batch do the block kernels beat dequantized tiles?

Self-contained (weights in, decision out) so the machine-defaults probe can call it beside its
dtype probe. It times one pass over enough layers' copies of one projection (the largest of a
layer) to stream twice the CPU's last-level cache (`probe_bytes`; every layer's where the model has
less), so the weights come from memory as in a real step rather than sitting in cache, at growing
batch sizes, and stops at the first size where the quantized (block) pass is not clearly faster.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve import kernels
from pdserve.kernels.gguf_formats import GGUFMatrix
from pdserve.kernels.gguf_linear import gguf_linear_native, gguf_linear_tiled
from pdserve.kernels.quant_linear import KernelWeight, quant_linear_native

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
BLOCK_BATCH_SIZES = (1, 4, 16, 32, 64, 128, 256)     # past 64 rows: prefill chunks
WIN_MARGIN = 0.9          # quantized must take at most 90% of the dense time to count as a win
MIN_PROBE_BYTES = 48 << 20      # where the CPU reports no cache size: more than most CPUs' last-level cache
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def probe_bytes(caches: Path = CPU_CACHES) -> int:
    """Dense bytes one probe pass streams: twice the largest cache the CPU reports, so that the weights come
    from memory as in a decode step over a whole model (a pass that fits the cache measures compute alone and
    favours the dense matmul: bench/RESULTS.md, "What the quantization probe streams")."""
    return max(MIN_PROBE_BYTES, 2 * last_level_cache_bytes(caches))


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int:
    """The largest cache sysfs reports for the first CPU, in bytes (0 where it reports none)."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        number, unit = (text[:-1], text[-1]) if text[-1:].upper() in SIZE_UNITS else (text, "")
        if number.isdigit():
            sizes.append(int(number) * SIZE_UNITS.get(unit.upper(), 1))
    return max(sizes, default=0)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    max_rows: int                                       # largest batch where quantized won (0: none)
    timings: tuple[tuple[int, float, float], ...]       # (rows, dense seconds, quantized seconds)

    def describe(self, dense: str = "dense", quantized: str = "quantized") -> str:
        return "; ".join(f"batch {rows}: {dense} {seconds * 1e3:.2f} ms, {quantized} {quant * 1e3:.2f} ms"
                         for rows, seconds, quant in self.timings)


def probe_quantized(dense: list[torch.Tensor], packed: list[KernelWeight], threads: int,
                    batch_sizes: tuple[int, ...] = BATCH_SIZES) -> ProbeResult:
    """Time the dense linear the model would run otherwise (kernels.linear: the native GEMV or BLAS,
    whichever wins there) over `dense` (weights [N, K] in the serving dtype) against the kernel over
    `packed` (the same weights quantized), with `threads` threads, at each batch size in turn."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timings, max_rows = [], 0
        for rows in batch_sizes:
            x = torch.randn(rows, dense[0].shape[1], dtype=dense[0].dtype)
            dense_s, quant_s = _best_passes(lambda x=x: [kernels.linear(x, w) for w in dense],
                                            lambda x=x: [quant_linear_native(x, w, threads) for w in packed])
            timings.append((rows, dense_s, quant_s))
            if quant_s > WIN_MARGIN * dense_s:
                break
            max_rows = rows
        return ProbeResult(max_rows, tuple(timings))
    finally:
        torch.set_num_threads(previous)


def probe_blocks(matrices: list[GGUFMatrix], dtype: torch.dtype, threads: int,
                 batch_sizes: tuple[int, ...] = BLOCK_BATCH_SIZES) -> ProbeResult:
    """Time dequantized tiles (the "dense" column of the result) against the block kernel over `matrices`
    with activations of `dtype`, at each batch size in turn, up to the first where the blocks lose."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timings, max_rows = [], 0
        for rows in batch_sizes:
            x = torch.randn(rows, matrices[0].in_features, dtype=dtype)
            tiles_s, blocks_s = _best_passes(lambda x=x: [gguf_linear_tiled(x, m, threads) for m in matrices],
                                             lambda x=x: [gguf_linear_native(x, m, threads) for m in matrices])
            timings.append((rows, tiles_s, blocks_s))
            if blocks_s > tiles_s:
                break
            max_rows = rows
        return ProbeResult(max_rows, tuple(timings))
    finally:
        torch.set_num_threads(previous)


def _best_passes(*runs, passes: int = 3) -> list[float]:
    """The fastest of `passes` timed passes of each run, the runs taking turns (so noise hits all)."""
    for run in runs:
        run()                                                # warm-up
    best = [float("inf")] * len(runs)
    for _ in range(passes):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - started)
    return best
