"""KV held by one sequence of a model with five sliding layers to one full, decoding far past its window.

    python -m pdserve.bench.window_memory --dir DIR [--window 128 --times 8 --family gemma3|gemma4]

The first run writes a random text checkpoint with transformers' own classes under DIR, with the demo model's
tokenizer beside it: Gemma 3 (six layers: five sliding with a `--window`-token window, one full), or Gemma 4 shaped
like E2B (twelve layers, five sliding to one full, the full layers' heads twice as large, the last six reading the
K and V of earlier layers). One request of a
`--window`-token prompt decodes to `--times` windows in colocated mode; once past the window, the most pool blocks
(the full layer's K and V) and window slots (the sliding layers', `engine.core.window_slots`) held at once are
counted. Reported: KV blocks held against the blocks the full layers alone need (the blocks and the slots each
counted once), the same in bytes, and the bytes against every layer keeping its own K and V for every token (for
Gemma 3 what serving keeps with KV tiers on, and what it kept before window slots).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path

from pdserve.bench.installed_names import prefer_installed
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.model.demo import make_model
from pdserve.engine.worker.memory import kv_layout

LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def write_checkpoint(root: Path, window: int, family: str) -> Path:
    out = root / f"{family}-5to1-w{window}"
    if (out / "config.json").is_file():
        return out
    prefer_installed()
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=16 * window, sliding_window=window,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, num_hidden_layers=6, layer_types=LAYERS))
    else:
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
            **common, num_hidden_layers=12, layer_types=LAYERS * 2, global_head_dim=32, num_kv_shared_layers=6,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=1024))
    model.save_pretrained(out)
    tokenizer = make_model(root / "demo-tokenizer", size="tiny", arch="llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


async def decode(engine: Engine, prompt: list[int], new_tokens: int, window: int) -> tuple[int, int]:
    """(most pool blocks, most window slots) held at once once the sequence passed its window."""
    blocks = engine.actors[0].blocks
    most_blocks = most_slots = tokens = 0
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    await engine.start()
    try:
        async for event in engine.submit(Request("w", tuple(prompt), params)):
            tokens += len(event.token_ids)
            if len(prompt) + tokens > window:
                most_blocks = max(most_blocks, blocks.num_used)
                most_slots = max(most_slots, blocks.windows.pool.num_held)
    finally:
        await engine.stop()
    return most_blocks, most_slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--times", type=int, default=8, help="decode to this many windows")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--family", choices=("gemma3", "gemma4"), default="gemma3")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = write_checkpoint(args.dir, args.window, args.family)
    config = EngineConfig(model=str(model), dtype="float32", mode="colocated",
                          scheduler=SchedulerConfig(max_model_len=(args.times + 1) * args.window,
                                                    ttft_slo_ms=1000.0, itl_slo_ms=100.0, startup_profile=False),
                          cache=CacheConfig(block_size=args.block_size, kv_cache_memory="64MiB"))
    engine = Engine(config)
    prompt = [(7 * i) % 1000 + 3 for i in range(args.window)]
    blocks, slots = asyncio.run(decode(engine, prompt, (args.times - 1) * args.window, args.window))
    per_slot = engine.actors[0].blocks.windows.pool.slots.blocks_per_slot
    shape = engine.served.config
    block = kv_layout(shape, args.block_size, split=True).block_elements
    every_layer = args.block_size * sum(2 * shape.layer_kv_heads(i) * shape.layer_head_dim(i)
                                        for i in range(shape.num_layers))
    result = {"family": args.family, "window": args.window, "tokens": args.times * args.window,
              "block_size": args.block_size, "pool_blocks_held": blocks, "window_slots_held": slots,
              "slot_blocks": per_slot, "blocks_vs_full_layers": (blocks + slots) / blocks,
              "bytes_vs_full_layers": (blocks + slots * per_slot) / blocks,
              "bytes_vs_every_layer": (blocks + slots * per_slot) * block / (blocks * every_layer)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
