"""Offline throughput: pdserve's engine against transformers' `generate` and llama.cpp on the same prompts.

    python experiments/offline_throughput.py --num-prompts 32 --input-len 128 --output-len 128 --compare-transformers
    python experiments/offline_throughput.py --model HF_DIR --llama-gguf F32.gguf --dtype float32 --mode colocated \\
        --batches 1,8,32 --prefill-len 1024          # llama.cpp too when llama-server is on PATH
    python experiments/offline_throughput.py --model Q4_K_M.gguf --llama-gguf Q4_K_M.gguf --quantization gguf \\
        --batches 1,8,32 --prefill-len 512 --rounds 3          # the same GGUF blocks, engines alternating

For each batch size: a max_tokens=1 pass gives the prefill time, a full pass the rest; decode
tokens/s is batch * (output_len - 1) over the difference, and a decode step's time follows. With
--prefill-len, one prompt of that length is prefilled alone (tokens/s). Each engine runs in its own
fresh subprocess, one after the other in the same run (a CPU thread team one engine leaves behind
slows the other: commit 823867d); with --rounds N the engines take turns N times and every figure is
the median of its N runs, printed with their spread. Each engine's peak resident memory is recorded
(pdserve's process; llama-server's). The machine's memory bandwidth (experiments/cpu_kernels.py bandwidth) is
measured in the same run, and every decode figure is printed with the bandwidth it achieved: the
weights plus the K/V read per step, over the step time. Writes the full result as JSON.
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import orjson
import torch

from pdserve.bench.documents import machine_description, write_json
from pdserve.bench.installed_names import prefer_installed
from pdserve.bench.llama_cpp import find_llama_server
from pdserve.engine.config import ModelConfig
from pdserve.engine.model.resolve import resolve_model
from pdserve.kernels.timing import best_seconds

from cpu_kernels import measure as measure_bandwidth

RESULT_PREFIX = "offline-throughput-result: "
ENGINES = ("pdserve", "transformers", "llama.cpp")


def seeded_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=generator).tolist()


def measure(generate, args, prompts: list[list[int]], long_prompt: list[int] | None) -> dict:
    """Figures of one engine; generate(prompts, max_tokens) runs a pass that ignores EOS (greedy unless
    pdserve was given --temperature)."""
    generate(prompts[:2], 4)                                                       # warm-up
    by_batch = {}
    for batch in args.batches:
        prefill_s = best_seconds(lambda: generate(prompts[:batch], 1), args.repeats)
        total_s = best_seconds(lambda: generate(prompts[:batch], args.output_len), args.repeats)
        decode_s = max(total_s - prefill_s, 1e-9)
        by_batch[batch] = {"prefill_tok_s": batch * args.input_len / prefill_s,
                           "decode_tok_s": batch * (args.output_len - 1) / decode_s,
                           "step_ms": decode_s / (args.output_len - 1) * 1e3, "prefill_s": prefill_s,
                           "total_s": total_s}
    result = {"batches": by_batch}
    if long_prompt is not None:
        generate([long_prompt], 1)
        seconds = best_seconds(lambda: generate([long_prompt], 1), args.repeats)
        result["long_prefill_tok_s"] = len(long_prompt) / seconds
    return result


def bench_pdserve(args, prompts, long_prompt) -> dict:
    from dataclasses import replace

    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM

    config = EngineConfig(model=args.model, dtype=args.dtype, mode=args.mode, cpu_kernels=args.cpu_kernels,
                          quantization=args.quantization,
                          async_scheduling={"on": True, "off": False, "auto": None}[args.async_scheduling],
                          cache=CacheConfig(kv_cache_memory=args.kv_cache_memory,   # NOTE: llama.cpp: cache_prompt false
                                            enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=max(args.batches), max_model_len=args.max_model_len,
                                                    max_prefill_tokens=args.max_prefill_tokens))
    llm = LLM(config=config)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True)
    decode_actor = llm.engine.actors[-1]
    try:
        result = measure(lambda p, n: llm.generate(p, replace(params, max_tokens=n)), args, prompts, long_prompt)
    finally:
        llm.close()
    return {"engine": f"pdserve-{llm.engine.mode}", "dtype": str(llm.engine.layout.dtype), **result,
            **_step_split(decode_actor), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _step_split(actor) -> dict:
    """The decode actor's mean step over the whole run: host (schedule + launch + record) and device
    (forward + sampling) milliseconds."""
    steps = max(actor.steps, 1)
    return {"host_ms": actor.step_seconds / steps * 1e3, "device_ms": actor.runner.forward_seconds / steps * 1e3}


def bench_transformers(args, prompts, long_prompt) -> dict:
    prefer_installed()
    import transformers

    dtype = getattr(torch, args.dtype or "bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(args.model).path, dtype=dtype).eval()

    def generate(batch, new_tokens):
        with torch.inference_mode():
            model.generate(torch.tensor(batch), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)

    return {"engine": "transformers-generate", "dtype": str(dtype), **measure(generate, args, prompts, long_prompt)}


def bench_llama_cpp(args, prompts, long_prompt) -> dict:
    from pdserve.bench.llama_cpp import llama_server, timed_completions

    context = max(args.batches) * (args.input_len + args.output_len) + (args.prefill_len or 0) + 64
    memory = {}
    with llama_server(args.llama_server, Path(args.llama_gguf), args.threads, context,
                      max(args.batches), args.llama_kv_type, memory=memory) as url:
        result = measure(lambda p, n: timed_completions(url, p, n), args, prompts, long_prompt)
    return {"engine": "llama.cpp-server", "dtype": f"gguf weights, kv {args.llama_kv_type}", **result, **memory}


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                total += torch.Size(f.get_slice(name).get_shape()).numel()
    return total


def weight_bytes(args, element: int) -> int:
    """The weights a decode step streams: the GGUF file's tensors as stored when the run keeps its blocks
    (--quantization gguf), else every parameter at `element` bytes."""
    if args.quantization == "gguf" and Path(args.model).is_file():
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(args.model).tensors)
    return parameter_count(resolve_model(args.model).path) * element


def bytes_per_step(args, config: ModelConfig, batch: int) -> float:
    """Weights plus the K/V a decode step of `batch` reads, at the mean context of the pass."""
    element = 2 if args.dtype in (None, "bfloat16", "float16") else 4
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * element
    mean_context = args.input_len + args.output_len / 2
    return weight_bytes(args, element) + batch * mean_context * kv_per_token


def report(args, results: list[dict], bandwidth: dict) -> None:
    config = ModelConfig.from_dir(resolve_model(args.model).path)
    ceiling = bandwidth["read_gb_s"]
    print(f"memory bandwidth ({bandwidth['threads']} threads): read {ceiling:.1f} GB/s, "
          f"copy {bandwidth['copy_gb_s']:.1f} GB/s, triad {bandwidth['triad_gb_s']:.1f} GB/s")
    for r in results:
        for batch, b in r["batches"].items():
            achieved = bytes_per_step(args, config, int(batch)) / (b["step_ms"] / 1e3) / 1e9
            print(f"{r['engine']:<24} {r['dtype']:<22} batch {int(batch):>3}: prefill {b['prefill_tok_s']:8.1f} tok/s  "
                  f"decode {b['decode_tok_s']:8.1f} tok/s  step {b['step_ms']:7.1f} ms{_spread(b, 'step_ms')}  "
                  f"{achieved:5.1f} GB/s of {ceiling:.1f}")
        if "long_prefill_tok_s" in r:
            print(f"{r['engine']:<24} {r['dtype']:<22} one {args.prefill_len}-token prompt: "
                  f"prefill {r['long_prefill_tok_s']:8.1f} tok/s{_spread(r, 'long_prefill_tok_s')}")
        if "peak_rss_bytes" in r:
            print(f"{r['engine']:<24} peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    _versus_llama_cpp(results)


def _spread(figures: dict, key: str) -> str:
    low, high = figures.get(f"{key}_spread", (None, None))
    return "" if low is None else f" ({low:.1f}-{high:.1f})"


def _versus_llama_cpp(results: list[dict]) -> None:
    """pdserve's time per token and prefill rate over llama.cpp's, per batch (targets: at most 1x, at least 1x)."""
    ours = next((r for r in results if r["engine"].startswith("pdserve")), None)
    theirs = next((r for r in results if r["engine"].startswith("llama.cpp")), None)
    if ours is None or theirs is None:
        return
    for batch, b in ours["batches"].items():
        ratio = b["step_ms"] / theirs["batches"][batch]["step_ms"]
        print(f"pdserve / llama.cpp, batch {int(batch):>3}: time per token {ratio:.2f}x (target <= 1)")
    if "long_prefill_tok_s" in ours and "long_prefill_tok_s" in theirs:
        print(f"pdserve / llama.cpp, one long prompt: prefill rate "
              f"{ours['long_prefill_tok_s'] / theirs['long_prefill_tok_s']:.2f}x (target >= 1)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--mode", default=None, choices=("adaptive", "disaggregated", "colocated"))
    p.add_argument("--cpu-kernels", default="auto", choices=("auto", "native", "torch"))
    p.add_argument("--quantization", default="none", choices=("none", "int8", "gguf", "auto"),
                   help="pdserve's --quantization (gguf with --model FILE.gguf: the blocks llama.cpp reads too)")
    p.add_argument("--num-prompts", type=int, default=32, help="the batch size when --batches is not given")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes, e.g. 1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=None, help="also prefill one prompt of this many tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--repeats", type=int, default=1, help="passes per figure; the best is kept")
    p.add_argument("--rounds", type=int, default=1, help="times the engines take turns; figures are the medians")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp's -t")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="pdserve's sampling temperature (default 0: greedy; the other engines stay greedy)")
    p.add_argument("--async-scheduling", choices=("on", "off", "auto"), default="auto",
                   help="schedule each step while the previous one runs (auto: the engine's default)")
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (default: on PATH)")
    p.add_argument("--llama-gguf", default=None, help="GGUF of the same weights for llama.cpp")
    p.add_argument("--llama-kv-type", default="f32", help="llama.cpp's -ctk/-ctv (f32 matches pdserve float32)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.num_prompts]
    if args.engine:
        return _run_one(args)
    args.llama_server = find_llama_server(args.llama_server) if args.llama_gguf else None
    engines = (["pdserve"] + (["transformers"] if args.compare_transformers else [])
               + (["llama.cpp"] if args.llama_server else []))
    rounds = [[_in_subprocess(args, engine) for engine in engines] for _ in range(args.rounds)]
    results = [median_result([r[i] for r in rounds]) for i in range(len(engines))]
    bandwidth = measure_bandwidth(args.threads)
    report(args, results, bandwidth)
    record = {"args": vars(args), "machine": {"description": machine_description(), "capability": torch.backends.cpu.get_cpu_capability()}, "memory_bandwidth": bandwidth, "results": results,
              "rounds": rounds}
    if args.result_json:
        write_json(args.result_json, record)
    return 0


def median_result(runs: list[dict]) -> dict:
    """One engine's runs as one result: every number the median of the runs' (a dict per batch likewise),
    with "<name>_spread": [min, max] beside it where there were several runs; text from the first run."""
    merged = {}
    for key, first in runs[0].items():
        values = [run[key] for run in runs]
        if isinstance(first, dict):
            merged[key] = median_result(values)
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            merged[key] = statistics.median(values)
            if len(runs) > 1:
                merged[f"{key}_spread"] = [min(values), max(values)]
        else:
            merged[key] = first
    return merged


def _run_one(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")     # NOTE: to stderr, read by main
    torch.manual_seed(args.seed)
    vocab = ModelConfig.from_dir(resolve_model(args.model).path).vocab_size
    prompts = seeded_prompts(max(args.batches), args.input_len, vocab, args.seed)
    long_prompt = seeded_prompts(1, args.prefill_len, vocab, args.seed + 1)[0] if args.prefill_len else None
    bench = {"pdserve": bench_pdserve, "transformers": bench_transformers, "llama.cpp": bench_llama_cpp}[args.engine]
    print(RESULT_PREFIX + orjson.dumps(bench(args, prompts, long_prompt), option=orjson.OPT_NON_STR_KEYS).decode())
    return 0


def _in_subprocess(args: argparse.Namespace, engine: str) -> dict:
    skip = ("result_json", "compare_transformers", "engine", "batches", "rounds")
    child = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
             if value is not None and name not in skip]
    child.append("--batches=" + ",".join(map(str, args.batches)))
    done = subprocess.run([sys.executable, __file__, *child, f"--engine={engine}"],
                          check=True, capture_output=True, text=True)
    for decision in (line for line in done.stderr.splitlines() if "cpu-kernels" in line or "quantization " in line):
        print(decision, file=sys.stderr)                  # NOTE: what the engine chose at start-up
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX))
    return orjson.loads(line[len(RESULT_PREFIX):])


if __name__ == "__main__":
    raise SystemExit(main())
