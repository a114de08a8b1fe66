"""KV transfer bandwidth of each backend between two devices (cuda:0 -> cuda:1 when there are two GPUs).

    python -m pdserve.bench.transfer_bench [--src cuda:0] [--dst cuda:1] [--mib 1024] [--out DIR]

Copies a pool's blocks in shuffled runs of 16 with `torch`, `cupy-p2p` and `staged`, checks every
copied byte, and prints GB/s (bytes moved / the handle's CUDA-event time, median of --iters) next to
a plain device-to-device `copy_` of the same bytes. With one GPU every backend copies within it;
on CPU only `torch` runs (a dry run). Writes DIR/transfer_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import torch

from pdserve.engine.transfer.base import TransferUnavailable
from pdserve.engine.transfer.cupy_p2p import CupyP2PTransfer, import_cupy_runtime
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.transfer.staged import StagedTransfer
from pdserve.engine.transfer.torch_copy import TorchTransfer

BLOCK_GEOMETRY = (32, 2, 16, 8, 128)       # layers, k/v, block size, kv heads, head dim: 2 MiB in bf16
RUN = 16


def make_backend(name: str, src: torch.device, dst: torch.device):
    if name == "torch":
        return TorchTransfer()
    if src.type != "cuda":
        raise TransferUnavailable(f"{name} needs CUDA")
    if name == "staged":
        return StagedTransfer(src, dst)
    if src == dst:
        return CupyP2PTransfer(import_cupy_runtime(), src, dst)
    return select_transfer(src, dst, forced="cupy-p2p")


def shuffled_runs(num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    starts = list(range(0, num_blocks, RUN))
    random.Random(seed).shuffle(starts)
    src = [b for s in starts for b in range(s, min(s + RUN, num_blocks))]
    dst = sorted(src)
    return src, dst


def measure(transfer, src_pool, dst_pool, iters: int) -> tuple[float, bool]:
    """(median seconds per copy of the whole pool, whether every block arrived intact)."""
    src_ids, dst_ids = shuffled_runs(src_pool.shape[0], 0)
    seconds = []
    for _ in range(iters + 2):
        handle = transfer.copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
        handle.wait()
        seconds.append(handle.seconds)
    exact = torch.equal(dst_pool[dst_ids].cpu(), src_pool[src_ids].cpu())
    return statistics.median(seconds[2:]), exact


def plain_copy_seconds(src_pool, dst_pool, iters: int) -> float:
    if src_pool.device.type != "cuda":
        return float("nan")
    samples = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst_pool.copy_(src_pool)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples[2:])


def run(src: torch.device, dst: torch.device, mib: int, iters: int) -> dict:
    block_bytes = torch.Size(BLOCK_GEOMETRY).numel() * 2
    num_blocks = max(RUN, mib * 2**20 // block_bytes)
    src_pool = torch.randn(num_blocks, *BLOCK_GEOMETRY, device=src).to(torch.bfloat16)
    dst_pool = torch.zeros_like(src_pool, device=dst)
    nbytes = num_blocks * block_bytes
    ceiling = plain_copy_seconds(src_pool, dst_pool, iters)
    rows = [{"backend": "copy_ (ceiling)", "gb_per_s": nbytes / ceiling / 1e9, "exact": True}]
    for name in ("torch", "cupy-p2p", "staged"):
        try:
            seconds, exact = measure(make_backend(name, src, dst), src_pool, dst_pool.zero_(), iters)
            rows.append({"backend": name, "gb_per_s": nbytes / seconds / 1e9, "exact": exact})
        except TransferUnavailable as exc:
            rows.append({"backend": name, "skipped": str(exc)})
    return {"src": str(src), "dst": str(dst), "bytes": nbytes, "block_bytes": block_bytes,
            "peer_access": _peers(src, dst), "rows": rows}


def _peers(src: torch.device, dst: torch.device) -> bool | None:
    if src.type != "cuda" or src == dst:
        return None
    return torch.cuda.can_device_access_peer(src, dst)


def table(result: dict) -> str:
    lines = [f"{result['src']} -> {result['dst']}, {result['bytes'] / 2**20:.0f} MiB in runs of {RUN} "
             f"blocks of {result['block_bytes'] / 2**20:.0f} MiB, peer access {result['peer_access']}",
             f"{'backend':<16} {'GB/s':>8}  exact"]
    for row in result["rows"]:
        if "skipped" in row:
            lines.append(f"{row['backend']:<16} {'-':>8}  skipped: {row['skipped']}")
        else:
            lines.append(f"{row['backend']:<16} {row['gb_per_s']:>8.1f}  {row['exact']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="cuda:0" if cuda else "cpu")
    p.add_argument("--dst", default=("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0") if cuda else "cpu")
    p.add_argument("--mib", type=int, default=1024 if cuda else 16)
    p.add_argument("--iters", type=int, default=10 if cuda else 2)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    args = p.parse_args(argv)
    result = run(torch.device(args.src), torch.device(args.dst), args.mib, args.iters)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer_bench.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0 if all(row.get("exact", True) for row in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
