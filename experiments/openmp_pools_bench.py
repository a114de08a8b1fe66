"""What an idle OpenMP pool on another thread costs a step, and what giving it back recovers.

    python experiments/openmp_pools_bench.py [--threads 2] [--rounds 5] [--out DIR]

A "step" thread runs small element-wise ops (a decode layer's norms and activations: 1 MB of float32) and a
bf16 GEMV (a projection of one decode row) on `--threads` threads, in three conditions interleaved round by
round: alone; with a second thread's idle pool of as many threads (what an adaptive unit's partner kept after
stepping on lent cores); and after that thread gave its pool back (`pdserve.engine.worker.openmp`). Prints the
median time of each op per condition and its ratio to "alone", and writes DIR/openmp_pools_bench.json (DIR:
--out, else $OUT, else experiments/out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pdserve.bench.documents import machine_description, write_json
from pdserve.engine.worker.openmp import release_thread_pool

CONDITIONS = ("alone", "idle pool elsewhere", "pool given back")


def _ops() -> dict:
    small = torch.randn(1 << 18)
    weight, row = torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(1, 2048, dtype=torch.bfloat16)
    return {"element-wise 1 MB": (lambda: torch.add(small, 1.0), 2000),
            "bf16 GEMV 2048x2048": (lambda: torch.nn.functional.linear(row, weight), 300)}


def _time(fn, calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def measure(threads: int, rounds: int) -> dict:
    ops = _ops()
    step = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    other = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    on_step, on_other = (lambda fn, *a: step.submit(fn, *a).result()), (lambda fn, *a: other.submit(fn, *a).result())
    samples = {c: {name: [] for name in ops} for c in CONDITIONS}
    try:
        for _ in range(rounds):
            for condition in CONDITIONS:
                if condition == "idle pool elsewhere":
                    on_other(ops["element-wise 1 MB"][0])          # the other thread's pool now exists, idle
                    time.sleep(0.2)
                elif condition == "pool given back":
                    on_other(release_thread_pool)
                for name, (fn, calls) in ops.items():
                    samples[condition][name].append(on_step(_time, fn, calls))
            on_step(release_thread_pool)
    finally:
        step.shutdown()
        other.shutdown()
    medians = {c: {name: statistics.median(v) for name, v in ops_.items()} for c, ops_ in samples.items()}
    return {"threads": threads, "rounds": rounds, "median_seconds": medians,
            "ratio_to_alone": {c: {name: medians[c][name] / medians["alone"][name] for name in ops} for c in CONDITIONS}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = measure(args.threads, args.rounds)
    print(f"{machine_description()}; {args.threads} threads, {args.rounds} rounds, medians")
    for condition in CONDITIONS:
        cells = [f"{name} {result['median_seconds'][condition][name] * 1e6:.0f} us "
                 f"({result['ratio_to_alone'][condition][name]:.2f}x)" for name in result["median_seconds"][condition]]
        print(f"  {condition:20s} " + "; ".join(cells))
    out = Path(args.out or os.environ.get("OUT") or "experiments/out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "openmp_pools_bench.json", {"machine": machine_description(), **result})


if __name__ == "__main__":
    main()
