"""Kernel micro-benchmark: each Triton kernel against the plain-torch path and the device ceilings.

Ceilings are measured in the same run: a large device-to-device copy (bandwidth) and a large
matmul (FLOP/s). On CPU it runs tiny sizes, reference path only, as a smoke test.

    python -m pdserve.bench.kernel_bench [--device cuda|cpu] [--out DIR]

Prints a table last; writes the full result to DIR/kernel_bench.json (DIR: --out, else $OUT,
else bench/out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from pdserve.kernels._triton import HAS_TRITON
from pdserve.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from pdserve.kernels.decode_attention import (
    decode_attention_ref,
    decode_attention_triton,
    default_num_splits,
)
from pdserve.kernels.gated_delta import causal_conv1d_ref, gated_delta_rule_ref
from pdserve.kernels.gated_delta_triton import causal_conv1d_triton, gated_delta_rule_triton
from pdserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from pdserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from pdserve.kernels.rotary import rotary_ref, rotary_triton
from pdserve.kernels.store_kv import store_kv_ref, store_kv_triton


@dataclass(frozen=True, slots=True)
class Sizes:
    decode_batch: int
    decode_context: int
    prefill_tokens: int
    tokens: int
    hidden: int
    intermediate: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192


GPU_SIZES = Sizes(decode_batch=64, decode_context=4096, prefill_tokens=4096, tokens=4096, hidden=4096,
                  intermediate=14336)
CPU_SIZES = Sizes(decode_batch=4, decode_context=256, prefill_tokens=128, tokens=64, hidden=512,
                  intermediate=1024, num_q_heads=8, num_kv_heads=2, head_dim=64, copy_bytes=64 << 20,
                  matmul_n=512)
TARGETS = {"decode_attention": ("bandwidth", 0.70), "prefill_attention": ("flops", 0.40)}


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    shape: str
    bound: str  # "bandwidth" or "flops"
    work: float  # bytes or FLOPs per call
    torch_ms: float
    triton_ms: float | None

    def rate(self, ms: float | None) -> float | None:
        return None if ms is None else self.work / (ms * 1e-3)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def measure_ceilings(sizes: Sizes, device: torch.device) -> dict:
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, iters=20)
    del src, dst
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = sizes.matmul_n
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    matmul_ms = time_ms(lambda: a @ b, device, iters=20)
    return {"copy_bytes_per_s": 2 * sizes.copy_bytes / (copy_ms * 1e-3),
            "matmul_flops_per_s": 2 * n ** 3 / (matmul_ms * 1e-3), "matmul_dtype": str(dtype)}


def paged_pool(sizes: Sizes, num_seqs: int, context: int, dtype, device) -> tuple:
    blocks_per_seq = -(-context // sizes.block_size)
    pool = torch.randn(num_seqs * blocks_per_seq, 1, 2, sizes.block_size, sizes.num_kv_heads, sizes.head_dim,
                       device=device, dtype=dtype)
    tables = torch.randperm(num_seqs * blocks_per_seq, device=device).to(torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    return pool, tables, lens


def bench_decode(sizes: Sizes, device, dtype, use_triton: bool, iters: int) -> tuple[Row, dict]:
    s, hq, hkv, d = sizes.decode_batch, sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim
    pool, tables, lens = paged_pool(sizes, s, sizes.decode_context, dtype, device)
    q = torch.randn(s, hq, d, device=device, dtype=dtype)
    scale = d ** -0.5
    work = (2 * s * sizes.decode_context * hkv * d + 2 * s * hq * d) * pool.element_size()
    torch_ms = time_ms(lambda: decode_attention_ref(q, pool, 0, tables, lens, scale), device, iters)
    sweep = {}
    if use_triton:
        default = default_num_splits(s, hkv, tables.shape[1] * sizes.block_size, device)
        for splits in sorted({1, 2, 4, 8, 16, 32, default}):
            sweep[splits] = time_ms(lambda: decode_attention_triton(q, pool, 0, tables, lens, scale, splits),
                                    device, iters)
        extra = {"default_num_splits": default, "ms_by_num_splits": sweep}
    else:
        extra = {}
    shape = f"S={s} ctx={sizes.decode_context} Hq={hq} Hkv={hkv} D={d} bs={sizes.block_size}"
    row = Row("decode_attention", shape, "bandwidth", work, torch_ms, sweep[default] if sweep else None)
    return row, extra


def bench_prefill(sizes: Sizes, device, dtype, use_triton: bool, iters: int) -> Row:
    t, hq, d = sizes.prefill_tokens, sizes.num_q_heads, sizes.head_dim
    pool, tables, lens = paged_pool(sizes, 1, t, dtype, device)
    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    q = torch.randn(t, hq, d, device=device, dtype=dtype)
    scale = d ** -0.5
    work = 4.0 * hq * d * t * (t + 1) / 2  # causal QK^T and PV
    torch_ms = time_ms(lambda: prefill_attention_ref(q, pool, 0, cu, lens, tables, scale), device, iters)
    triton_ms = time_ms(lambda: prefill_attention_triton(q, pool, 0, cu, lens, tables, scale),
                        device, iters) if use_triton else None
    return Row("prefill_attention", f"T={t} Hq={hq} Hkv={sizes.num_kv_heads} D={d} causal", "flops", work,
               torch_ms, triton_ms)


def elementwise_cases(sizes: Sizes, device, dtype) -> list[tuple]:
    """(name, shape, bytes moved, torch fn, triton fn) for the memory-bound kernels."""
    t, h, i, hq, hkv, d = (sizes.tokens, sizes.hidden, sizes.intermediate, sizes.num_q_heads,
                           sizes.num_kv_heads, sizes.head_dim)
    size = torch.tensor([], dtype=dtype).element_size()
    x, r = torch.randn(t, h, device=device, dtype=dtype), torch.randn(t, h, device=device, dtype=dtype)
    w = torch.randn(h, device=device, dtype=dtype)
    gate_up = torch.randn(t, 2 * i, device=device, dtype=dtype)
    q, k = torch.randn(t, hq, d, device=device, dtype=dtype), torch.randn(t, hkv, d, device=device, dtype=dtype)
    cos_sin, positions = torch.randn(8192, d, device=device), torch.randint(0, 8192, (t,), device=device)
    pool = torch.empty(-(-t // sizes.block_size) + 1, 1, 2, sizes.block_size, hkv, d, device=device, dtype=dtype)
    slots = torch.randperm(t, device=device)
    return [
        ("rms_norm+residual", f"T={t} H={h}", 4 * t * h * size,
         lambda: rms_norm_ref(x, w, 1e-5, r), lambda: rms_norm_triton(x, w, 1e-5, r)),
        ("rotary", f"T={t} Hq={hq} Hkv={hkv} D={d}", 2 * t * (hq + hkv) * d * size + t * d * 4,
         lambda: rotary_ref(q, k, positions, cos_sin), lambda: rotary_triton(q, k, positions, cos_sin)),
        ("silu_and_mul", f"T={t} I={i}", 3 * t * i * size,
         lambda: silu_and_mul_ref(gate_up), lambda: silu_and_mul_triton(gate_up)),
        ("store_kv", f"T={t} Hkv={hkv} D={d}", 4 * t * hkv * d * size,
         lambda: store_kv_ref(k, k, pool, 0, slots), lambda: store_kv_triton(k, k, pool, 0, slots)),
    ]


def gated_delta_cases(sizes: Sizes, device, dtype) -> list[tuple]:
    """(name, shape, bound, work, torch fn, triton fn) for a Gated DeltaNet layer's stateful ops, value heads as
    many as q heads and key heads as KV heads: the delta rule's decode step (each state read and written once),
    its prefill of one sequence (the recurrence's FLOPs; Triton steps token by token) and that prefill's conv."""
    s, t, hv, hk, d = sizes.decode_batch, sizes.prefill_tokens, sizes.num_q_heads, sizes.num_kv_heads, sizes.head_dim
    size = torch.tensor([], dtype=dtype).element_size()

    def rows(n: int) -> tuple:
        return (torch.randn(n, hk, d, device=device, dtype=dtype), torch.randn(n, hk, d, device=device, dtype=dtype),
                torch.randn(n, hv, d, device=device, dtype=dtype), -0.1 * torch.rand(n, hv, device=device),
                torch.rand(n, hv, device=device, dtype=dtype))

    decode, prefill = rows(s), rows(t)
    states, slots = torch.zeros(s, hv, d, d, device=device), torch.arange(s, device=device)
    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    channels = (2 * hk + hv) * d
    x = torch.randn(t, channels, device=device, dtype=dtype)
    weight = torch.randn(channels, 4, device=device, dtype=dtype)
    conv_states = torch.zeros(1, channels, 3, device=device)
    heads = f"Hv={hv} Hk={hk} D={d}"
    return [
        ("delta_rule decode", f"S={s} {heads}", "bandwidth", 2 * states.numel() * 4 + s * (2 * hk + 2 * hv) * d * size,
         lambda: gated_delta_rule_ref(*decode, states, slots),
         lambda: gated_delta_rule_triton(*decode, states, slots)),
        ("delta_rule prefill", f"T={t} {heads}", "flops", 6.0 * t * hv * d * d,
         lambda: gated_delta_rule_ref(*prefill, states, slots[:1], cu),
         lambda: gated_delta_rule_triton(*prefill, states, slots[:1], cu)),
        ("conv1d prefill", f"T={t} C={channels} K=4", "bandwidth", 2 * t * channels * size,
         lambda: causal_conv1d_ref(x, weight, conv_states, slots[:1], cu),
         lambda: causal_conv1d_triton(x, weight, conv_states, slots[:1], cu)),
    ]


def run(device: torch.device) -> dict:
    on_cuda = device.type == "cuda"
    sizes, dtype, iters = (GPU_SIZES, torch.bfloat16, 20) if on_cuda else (CPU_SIZES, torch.float32, 3)
    use_triton = on_cuda and HAS_TRITON
    torch.manual_seed(0)
    ceilings = measure_ceilings(sizes, device)
    decode_row, decode_extra = bench_decode(sizes, device, dtype, use_triton, iters)
    rows = [decode_row, bench_prefill(sizes, device, dtype, use_triton, iters)]
    for name, shape, work, torch_fn, triton_fn in elementwise_cases(sizes, device, dtype):
        triton_ms = time_ms(triton_fn, device, iters) if use_triton else None
        rows.append(Row(name, shape, "bandwidth", work, time_ms(torch_fn, device, iters), triton_ms))
    for name, shape, bound, work, torch_fn, triton_fn in gated_delta_cases(sizes, device, dtype):
        triton_ms = time_ms(triton_fn, device, iters) if use_triton else None
        rows.append(Row(name, shape, bound, work, time_ms(torch_fn, device, iters), triton_ms))
    return {"device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "sizes": asdict(sizes), "ceilings": ceilings,
            "decode_attention": decode_extra, "rows": [summarize(row, ceilings) for row in rows]}


def summarize(row: Row, ceilings: dict) -> dict:
    ceiling = ceilings["copy_bytes_per_s" if row.bound == "bandwidth" else "matmul_flops_per_s"]
    best_ms = row.triton_ms if row.triton_ms is not None else row.torch_ms
    fraction = row.rate(best_ms) / ceiling
    target = TARGETS.get(row.name, (row.bound, None))[1]
    return {**asdict(row), "rate_torch": row.rate(row.torch_ms), "rate_triton": row.rate(row.triton_ms),
            "fraction_of_ceiling": fraction, "target_fraction": target,
            "meets_target": None if target is None or row.triton_ms is None else fraction >= target}


def table(result: dict) -> str:
    ceilings = result["ceilings"]
    lines = [f"device {result['device']}  {result['dtype']}  copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s  "
             f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.4g} TFLOP/s",
             f"{'kernel':<18} {'torch ms':>9} {'triton ms':>9} {'speedup':>7} {'achieved':>14} {'ceil':>6} "
             f"{'target':>6}  shape"]
    for row in result["rows"]:
        triton_ms = row["triton_ms"]
        triton_text = "-" if triton_ms is None else f"{triton_ms:.3f}"
        speedup = "-" if triton_ms is None else f"{row['torch_ms'] / triton_ms:.1f}x"
        unit, scale = ("GB/s", 1e9) if row["bound"] == "bandwidth" else ("TFLOP/s", 1e12)
        best = row["rate_triton"] if triton_ms is not None else row["rate_torch"]
        target = "-" if row["target_fraction"] is None else f"{row['target_fraction']:.0%}"
        if row["meets_target"] is not None:
            target += " ok" if row["meets_target"] else " MISS"
        lines.append(f"{row['name']:<18} {row['torch_ms']:>9.3f} {triton_text:>9} {speedup:>7} "
                     f"{best / scale:>7.4g} {unit:<7}{row['fraction_of_ceiling']:>5.0%} {target:>6}  {row['shape']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    result = run(torch.device(args.device))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernel_bench.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out_dir / 'kernel_bench.json'}")
    print(table(result))


if __name__ == "__main__":
    main()
