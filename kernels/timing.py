"""The one stopwatch of the kernels' own measurements and of the CPU micro-benchmarks."""
from __future__ import annotations

import time


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn (the minimum leaves a slow first call out)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
