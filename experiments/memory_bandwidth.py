"""STREAM-like memory bandwidth of this machine: the ceiling a decode step is compared against.

    python experiments/memory_bandwidth.py --threads 2

Arrays of 256 MiB each (far beyond any L3) through torch's own parallel kernels: copy (a = b,
counted as read + write like STREAM), triad (a = b + s*c, 2 reads + 1 write) and read (sum(b), the
access pattern of a batch-1 decode step streaming its weights). Best of --repeats. Prints one line;
`measure()` returns the figures for other benchmarks to print next to their own.
"""
from __future__ import annotations

import argparse
import os

import torch

from pdserve.bench.documents import write_json
from pdserve.kernels.timing import best_seconds

ARRAY_BYTES = 256 << 20


def measure(threads: int | None = None, repeats: int = 5, array_bytes: int = ARRAY_BYTES) -> dict:
    """{"copy_gb_s", "triad_gb_s", "read_gb_s", "threads"}: decimal GB/s, best of `repeats`."""
    previous = torch.get_num_threads()
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    try:
        n = array_bytes // 4
        a, b, c = (torch.rand(n) for _ in range(3))
        copy = best_seconds(lambda: a.copy_(b), repeats)
        triad = best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
        read = best_seconds(lambda: b.sum(), repeats)
    finally:
        torch.set_num_threads(previous)
    return {"threads": threads, "copy_gb_s": 2 * array_bytes / copy / 1e9,
            "triad_gb_s": 3 * array_bytes / triad / 1e9, "read_gb_s": array_bytes / read / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="default: every core this process may use")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    result = measure(args.threads, args.repeats)
    print(f"memory bandwidth, {result['threads']} threads: copy {result['copy_gb_s']:.1f} GB/s, "
          f"triad {result['triad_gb_s']:.1f} GB/s, read {result['read_gb_s']:.1f} GB/s")
    if args.result_json:
        write_json(args.result_json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
