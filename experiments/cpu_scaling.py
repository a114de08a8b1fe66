"""Two threads against one on a float32 GEMM, sampled alternately once a second: whether this machine's second core
always adds a core's worth (on a shared VM two vCPUs can land on one physical core's two hardware threads), which
every two-thread step, and every profile and cost model fitted to one, inherits.

    python experiments/cpu_scaling.py [--samples 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

A, B = torch.randn(64, 2048), torch.randn(2048, 2048)


def seconds(threads: int, repeats: int = 20) -> float:
    torch.set_num_threads(threads)
    torch.mm(A, B)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(A, B)
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    ratios = []
    for _ in range(args.samples):
        ratios.append(seconds(1) / seconds(2))
        time.sleep(1.0)
    q = statistics.quantiles(ratios, n=4)
    print(f"2-thread speed-up over 1 thread, {args.samples} samples 1 s apart: min {min(ratios):.2f} "
          f"p25 {q[0]:.2f} median {statistics.median(ratios):.2f} p75 {q[2]:.2f} max {max(ratios):.2f}")


if __name__ == "__main__":
    main()
