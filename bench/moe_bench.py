"""One-stream decode of a mixture-of-experts checkpoint against a dense one with the same active parameters, on CPU.

    python -m pdserve.bench.moe_bench --dir DIR --threads 2

The first run writes two random checkpoints with transformers' own classes under DIR (kept for later runs): a
Qwen3-MoE (`--experts` experts of `--expert-size`, top `--top-k`, renormalised) and a Qwen3 whose MLP is
top-k x expert-size wide, so a token reads the same weights in both (the router's E x hidden aside). Each
dtype's two runners decode one sequence at `--context` tokens, `--rounds` rounds, the models taking turns,
`--iters` steps a measurement (the median counts, the best round is kept). Prints the step times, their ratio
(the target: MoE within 1.5x of dense) and the active weight bytes each step reads per second beside the
machine's read ceiling; the full result goes to `--out`.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from pdserve.bench.installed_names import prefer_installed
from pdserve.bench.quant_bench import DTYPES, memory_ceiling, step_seconds
from pdserve.engine.config import ModelConfig
from pdserve.engine.worker.model_runner import ModelRunner, load_model

TARGET_RATIO = 1.5


def write_checkpoints(root: Path, args) -> tuple[Path, Path]:
    """DIR/moe and DIR/dense (written once): random Qwen3-MoE and Qwen3 of the same active size, in float32."""
    prefer_installed()
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    models = {"moe": (transformers.Qwen3MoeConfig(**common, intermediate_size=args.top_k * args.expert_size,
                                                  num_experts=args.experts, num_experts_per_tok=args.top_k,
                                                  moe_intermediate_size=args.expert_size, norm_topk_prob=True),
                      transformers.Qwen3MoeForCausalLM),
              "dense": (transformers.Qwen3Config(**common, intermediate_size=args.top_k * args.expert_size),
                        transformers.Qwen3ForCausalLM)}
    for name, (config, cls) in models.items():
        out = root / name
        if not (out / "config.json").is_file():
            torch.manual_seed(0)
            cls(config).to(torch.float32).save_pretrained(out)
    return root / "moe", root / "dense"


def runner_for(model_dir: Path, dtype: str, context: int) -> tuple[ModelRunner, int]:
    """A runner over the checkpoint in `dtype`, and the weight bytes one decode row reads (active experts)."""
    config = ModelConfig.from_dir(model_dir)
    model = load_model(config, DTYPES[dtype], torch.device("cpu"), context + 64)
    runner = ModelRunner(model, -(-(context + 2) // 16), 16, frozenset())
    runner.kv_pool.normal_()
    return runner, config.weight_params * DTYPES[dtype].itemsize


def measure(dirs: dict[str, Path], args) -> list[dict]:
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtypes:
            runners = {name: runner_for(path, dtype, args.context) for name, path in dirs.items()}
            best = {name: float("inf") for name in runners}
            for _ in range(args.rounds):
                for name, (runner, _) in runners.items():
                    best[name] = min(best[name], step_seconds(runner, "decode", 1, args.context, args.iters))
            cell = {name: {"ms": best[name] * 1e3, "active_GBps": active / best[name] / 1e9}
                    for name, (_, active) in runners.items()}
            ratio = best["moe"] / best["dense"]
            rows.append({"threads": threads, "dtype": dtype, **cell, "ratio": ratio})
            print(f"{threads}t {dtype:9s} decode, batch 1: MoE {cell['moe']['ms']:.2f} ms "
                  f"({cell['moe']['active_GBps']:.1f} GB/s active), dense {cell['dense']['ms']:.2f} ms "
                  f"({cell['dense']['active_GBps']:.1f} GB/s): MoE / dense {ratio:.2f}x "
                  f"(target within {TARGET_RATIO}x: {'met' if ratio <= TARGET_RATIO else 'NOT met'})", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="where the two checkpoints are (written on first use)")
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=20, help="steps per measurement (the median counts)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per cell, the two models taking turns")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "moe_bench.json")
    args = p.parse_args(argv)
    moe, dense = write_checkpoints(args.dir, args)
    ceilings = {t: memory_ceiling(t) for t in args.threads}
    for t, c in ceilings.items():
        print(f"memory ceiling {t}t: read {c['read_GBps']:.1f} GB/s")
    rows = measure({"moe": moe, "dense": dense}, args)
    result = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
              "ceilings": ceilings, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
