"""The native linear (kernels/csrc/linear.cpp) at a few rows of x: does M rows cost what one row costs?

    python experiments/linear_rows_bench.py [--baseline ca0b5f4] [--threads 1,2] [--out DIR]

A speculative verify step runs 2..6 rows per sequence through every projection; the weights are
read once either way, so time(M rows) / time(1 row) near 1.0 is the target. For each weight shape
(SmolLM2-135M's and a 1.1B model's: hidden 2048, intermediate 5632), dtype and thread count, the
rows counts are timed interleaved (median of --repeats), each sample one pass over enough copies of
the weight to exceed twice the CPU's largest cache, so the weights stream from memory as in a real step. With
--baseline REV, linear.cpp (and common.h) of that commit is built as a second library and timed in
the same loop. Prints one line per case (ratio to one row, GB/s of weight read, next to the machine's
read bandwidth) and writes DIR/linear_rows_bench.json (DIR: --out, else $OUT, else experiments/out).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.documents import machine_description, write_json
from pdserve.engine.model.quant_probe import probe_bytes
from pdserve.kernels import native
from pdserve.kernels.native import INT, INT64, POINTER, SUFFIXES

from cpu_kernels import measure as measure_bandwidth

SHAPES = {  # name: (N, K)
    "135m.qkv": (960, 576), "135m.o": (576, 576), "135m.gate_up": (3072, 576), "135m.down": (576, 1536),
    "135m.lm_head": (49152, 576),
    "1b.qkv": (2560, 2048), "1b.o": (2048, 2048), "1b.gate_up": (11264, 2048), "1b.down": (2048, 5632),
}
STREAM_BYTES = 96 << 20  # each sample reads at least this much weight, and twice the CPU's largest cache
KERNEL_SOURCES = ("kernels/csrc/linear.cpp", "kernels/csrc/common.h")
REPO = Path(__file__).resolve().parent.parent


def linear_function(library: ctypes.CDLL, dtype: torch.dtype):
    function = getattr(library, f"pd_linear_{SUFFIXES[str(dtype)]}")
    function.argtypes, function.restype = (POINTER, INT64, POINTER, POINTER, POINTER, INT64, INT64, INT64, INT64,
                                           INT), None
    return function


def build_baseline(revision: str) -> ctypes.CDLL:
    """linear.cpp as it was at `revision`, built alone into its own library."""
    with tempfile.TemporaryDirectory() as scratch:
        for source in KERNEL_SOURCES:
            text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{source}"], capture_output=True,
                                  text=True, check=True).stdout
            (Path(scratch) / Path(source).name).write_text(text)
        library = native.load_native(f"linear_{revision}", (Path(scratch) / "linear.cpp",))
    if library is None:
        raise SystemExit(f"linear.cpp of {revision} did not build")
    return library


def time_pass(function, xs, weights, out, threads) -> float:
    """Seconds per weight of one call on each copy of the weight (a cold stream)."""
    rows, k = xs.shape
    n = weights[0].shape[0]
    start = time.perf_counter()
    for weight in weights:
        function(xs.data_ptr(), k, weight.data_ptr(), None, out.data_ptr(), n, rows, n, k, threads)
    return (time.perf_counter() - start) / len(weights)


def bench_case(functions: dict, shape, dtype, threads, row_counts, repeats) -> dict:
    """{label: {rows: seconds}}: every label and row count timed once per repeat, interleaved (labels
    in alternating order); the median over repeats of each time relative to the first label's
    one-row time of the same repeat (so a drift of the machine's bandwidth between repeats cancels),
    times the median of that one."""
    n, k = shape
    element = torch.finfo(dtype).bits // 8
    copies = max(2, -(-max(STREAM_BYTES, probe_bytes()) // (n * k * element)))
    gen = torch.Generator().manual_seed(n * k)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
    xs = {m: torch.randn(m, k, generator=gen).to(dtype) for m in row_counts}
    outs = {m: torch.empty(m, n, dtype=dtype) for m in row_counts}
    samples = {(label, m): [] for label in functions for m in row_counts}
    for repeat in range(repeats + 1):
        for m in row_counts:
            order = list(functions.items())
            for label, function in order[::-1] if repeat % 2 else order:  # no label always first
                seconds = time_pass(function[dtype], xs[m], weights, outs[m], threads)
                if repeat:  # the first round warms up
                    samples[label, m].append(seconds)
    reference = samples[next(iter(functions)), row_counts[0]]
    unit = statistics.median(reference)
    return {label: {m: unit * statistics.median(t / r for t, r in zip(samples[label, m], reference))
                    for m in row_counts} for label in functions}


def report_lines(name, shape, dtype, threads, medians, ceiling_gb_s) -> list[str]:
    """Per label: the one-row time and bandwidth, t(M)/t(1); per later label: the first's t(M) over its."""
    weight_bytes = shape[0] * shape[1] * (torch.finfo(dtype).bits // 8)
    lines, first = [], next(iter(medians))
    for label, by_rows in medians.items():
        one = by_rows[min(by_rows)]
        cells = "  ".join(f"M{m}:{t / one:4.2f}" for m, t in by_rows.items())
        lines.append(f"{name:13} {str(dtype)[6:]:8} {threads}t {label:9} 1 row {one * 1e6:8.1f} us "
                     f"{weight_bytes / one / 1e9:5.1f} GB/s (read {ceiling_gb_s:4.1f})  t(M)/t(1): {cells}")
        if label != first:
            cells = "  ".join(f"M{m}:{medians[first][m] / t:4.2f}" for m, t in by_rows.items())
            lines.append(f"{'':13} {'':8} {'':2} {first} / {label} (time):{'':17} {cells}")
    return lines


def summary(cases: list[dict], label: str, rows=(2, 3, 4, 5, 6)) -> str:
    """The median over cases of t(M)/t(1) for M in `rows`, for `label`."""
    ratios = [case["seconds"][label][m] / case["seconds"][label][min(case["seconds"][label])]
              for case in cases for m in rows if m in case["seconds"][label]]
    return f"{label}: median t(M)/t(1) over M in {rows} and {len(cases)} cases: {statistics.median(ratios):.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from: " + ", ".join(SHAPES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,2,3,4,5,6,8,16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--baseline", default=None, help="a git revision whose linear.cpp is timed alongside")
    p.add_argument("--out", default=os.environ.get("OUT") or "experiments/out")
    args = p.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    row_counts = sorted(map(int, args.rows.split(",")))
    libraries = {"current": native.cpu_kernels()}
    if args.baseline:
        libraries[args.baseline] = build_baseline(args.baseline)
    functions = {label: {d: linear_function(lib, d) for d in dtypes} for label, lib in libraries.items()}
    cases = []
    for threads in map(int, args.threads.split(",")):
        ceiling = measure_bandwidth(threads, repeats=3)["read_gb_s"]
        for name in args.shapes.split(","):
            for dtype in dtypes:
                medians = bench_case(functions, SHAPES[name], dtype, threads, row_counts, args.repeats)
                print("\n".join(report_lines(name, SHAPES[name], dtype, threads, medians, ceiling)), flush=True)
                cases.append({"shape": name, "n_k": SHAPES[name], "dtype": str(dtype), "threads": threads,
                              "read_gb_s": ceiling, "seconds": medians})
    for label in libraries:
        print(summary(cases, label))
    write_json(Path(args.out) / "linear_rows_bench.json",
               {"machine": machine_description(), "arguments": vars(args), "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
