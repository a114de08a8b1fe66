"""Peak resident memory of an engine with four CPU thread units against one unit: the units of one
process share one copy of the weights, so four should cost little more than one (target: at most 1.3x).

    python experiments/unit_memory.py --model demo:base --dtype bfloat16 --kv-cache-memory 64MiB

Each engine is built and serves one short request in a fresh subprocess (nothing else resident);
one unit is `--mode colocated --prefill-device cpu`, four are `--mode disaggregated --prefill-device
cpu,cpu --decode-device cpu,cpu`. Both share the same total KV budget, so the ratio measures weights.
Writes the figures as JSON to --out when given.
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


def _child(model: str, dtype: str, kv: str, layout: str) -> None:
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.messages import Request
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.engine import Engine
    from pdserve.engine.topology import resolve_model_dir

    model_dir = resolve_model_dir(model)               # generated before measuring, if needed
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, workers="thread",
                                 cache=CacheConfig(kv_cache_memory=kv), **LAYOUTS[layout]))

    async def one_request() -> None:
        await engine.start()
        try:
            async for _ in engine.submit(Request("m", tuple(range(3, 67)), SamplingParams(max_tokens=8))):
                pass
        finally:
            await engine.stop()

    asyncio.run(one_request())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    models = {id(a.runner.model): a.runner.model for a in engine.actors}
    print(json.dumps({"layout": layout, "units": len(engine.actors), "weight_copies": len(models),
                      "baseline_rss": baseline, "peak_rss": peak}))
    engine.close()


def _measure(args, layout: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", layout, "--model", args.model,
                          "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    p.add_argument("--child", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.model, args.dtype, args.kv_cache_memory, args.child)
        return 0
    results = {layout: _measure(args, layout) for layout in LAYOUTS}
    one, four = results["one"], results["four"]
    mib = 2 ** 20
    ratio = four["peak_rss"] / one["peak_rss"]
    print(f"peak RSS: one unit {one['peak_rss'] / mib:.1f} MiB, four units {four['peak_rss'] / mib:.1f} MiB "
          f"({four['weight_copies']} weight copies) = {ratio:.2f}x (target <= 1.3x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**results, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
