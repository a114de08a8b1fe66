"""Peak resident memory of an engine, each measured in a fresh subprocess (nothing else resident).

    python experiments/memory.py load --model demo:base --dtype bfloat16 --kv-cache-memory 256MiB
    python experiments/memory.py units --model demo:base --dtype bfloat16 --kv-cache-memory 64MiB [--out FILE]

load: growth of the peak RSS while an engine loads, against its weight bytes plus the KV pools it
allocated (target: at most 1.3x). units: one colocated CPU unit against four (two prefill, two decode)
with the same KV budget, each serving one short request; the units of one process share one copy of
the weights, so four should cost little more than one (target: at most 1.3x).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys

LAYOUTS = {"one": dict(mode="colocated", prefill_device="cpu", decode_device="cpu"),
           "four": dict(mode="disaggregated", prefill_device="cpu,cpu", decode_device="cpu,cpu")}
MIB = 2 ** 20


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_engine(model: str, dtype: str, kv: str, **layout):
    """(the engine, the RSS before it was built); the model is resolved (and generated if needed) first."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.model.resolve import resolve_model

    model_dir = resolve_model(model).path
    baseline = peak_rss()
    return Engine(EngineConfig(model=str(model_dir), dtype=dtype, cache=CacheConfig(kv_cache_memory=kv),
                               **layout)), baseline


def child_load(args) -> dict:
    import torch

    engine, baseline = build_engine(args.model, args.dtype, args.kv_cache_memory, mode=args.mode)
    peak = peak_rss()
    weights = sum(p.numel() * p.element_size() for p in engine.actors[0].runner.model.parameters())
    pools = {a.runner.kv_pool.data_ptr(): a.runner.kv_pool for a in engine.actors}
    kv_bytes = sum(t.numel() * t.element_size() for t in pools.values())
    engine.close()
    return {"baseline_rss": baseline, "peak_rss": peak, "weight_bytes": weights, "kv_bytes": kv_bytes,
            "torch": torch.__version__}


def child_units(args) -> dict:
    from pdserve.engine.core.messages import Request
    from pdserve.engine.core.sampling_params import SamplingParams

    engine, baseline = build_engine(args.model, args.dtype, args.kv_cache_memory, workers="thread",
                                    **LAYOUTS[args.layout])

    async def one_request() -> None:
        await engine.start()
        try:
            async for _ in engine.submit(Request("m", tuple(range(3, 67)), SamplingParams(max_tokens=8))):
                pass
        finally:
            await engine.stop()

    asyncio.run(one_request())
    peak = peak_rss()
    models = {id(a.runner.model): a.runner.model for a in engine.actors}
    result = {"layout": args.layout, "units": len(engine.actors), "weight_copies": len(models),
              "baseline_rss": baseline, "peak_rss": peak}
    engine.close()
    return result


def in_child(args, probe: str, *extra: str) -> dict:
    argv = [sys.executable, __file__, "--child", probe, "--model", args.model, "--dtype", args.dtype,
            "--kv-cache-memory", args.kv_cache_memory, *extra]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_load(args) -> None:
    r = in_child(args, "load", "--mode", args.mode)
    loaded = r["peak_rss"] - r["baseline_rss"]
    budget = r["weight_bytes"] + r["kv_bytes"]
    print(f"weights {r['weight_bytes'] / MIB:.1f} MiB + KV {r['kv_bytes'] / MIB:.1f} MiB; RSS before load "
          f"{r['baseline_rss'] / MIB:.1f} MiB, peak {r['peak_rss'] / MIB:.1f} MiB; growth while loading "
          f"{loaded / MIB:.1f} MiB = {loaded / budget:.2f} x (weights + KV)")


def run_units(args) -> None:
    results = {layout: in_child(args, "units", "--layout", layout) for layout in LAYOUTS}
    one, four = results["one"], results["four"]
    ratio = four["peak_rss"] / one["peak_rss"]
    print(f"peak RSS: one unit {one['peak_rss'] / MIB:.1f} MiB, four units {four['peak_rss'] / MIB:.1f} MiB "
          f"({four['weight_copies']} weight copies) = {ratio:.2f}x (target <= 1.3x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**results, "ratio": ratio}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("load", "units"))
    parser.add_argument("--model", default="demo:base")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default=None, help="default: 256MiB for load, 64MiB for units")
    parser.add_argument("--mode", default="disaggregated", help="load: the engine's mode")
    parser.add_argument("--out", default=None, help="units: write the figures here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.kv_cache_memory = args.kv_cache_memory or ("256MiB" if args.probe == "load" else "64MiB")
    if args.child:
        print(json.dumps(child_load(args) if args.probe == "load" else child_units(args)))
    elif args.probe == "load":
        run_load(args)
    else:
        run_units(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
