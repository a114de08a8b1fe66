"""Peak resident memory while loading a checkpoint, against its weight bytes plus the KV budget.

    python experiments/load_memory.py --model demo:base --dtype bfloat16 --kv-cache-memory 256MiB

The engine is built in a fresh subprocess (so nothing else is resident) and reports its peak RSS.
Target: peak <= 1.3 x (weights + KV) + the interpreter's own baseline (torch imported, nothing loaded).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _child(model: str, dtype: str, kv: str, mode: str) -> None:
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.topology import resolve_model_dir

    model_dir = resolve_model_dir(model)               # generated before measuring, if needed
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, mode=mode,
                                 cache=CacheConfig(kv_cache_memory=kv)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = sum(p.numel() * p.element_size() for p in engine.actors[0].runner.model.parameters())
    pools = {a.runner.kv_pool.data_ptr(): a.runner.kv_pool for a in engine.actors}
    kv_bytes = sum(t.numel() * t.element_size() for t in pools.values())
    print(json.dumps({"baseline_rss": baseline, "peak_rss": peak, "weight_bytes": weights,
                      "kv_bytes": kv_bytes, "torch": torch.__version__}))
    engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", default="disaggregated")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.model, args.dtype, args.kv_cache_memory, args.mode)
        return 0
    out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model,
                          "--dtype", args.dtype, "--mode", args.mode, "--kv-cache-memory", args.kv_cache_memory],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    loaded = r["peak_rss"] - r["baseline_rss"]
    budget = r["weight_bytes"] + r["kv_bytes"]
    mib = 2 ** 20
    print(f"weights {r['weight_bytes'] / mib:.1f} MiB + KV {r['kv_bytes'] / mib:.1f} MiB; RSS before load "
          f"{r['baseline_rss'] / mib:.1f} MiB, peak {r['peak_rss'] / mib:.1f} MiB; growth while loading "
          f"{loaded / mib:.1f} MiB = {loaded / budget:.2f} x (weights + KV)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
