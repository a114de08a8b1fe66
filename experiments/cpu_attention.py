"""CPU paged attention, SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16):
the native kernel that reads K/V in place against the reference that gathers them for SDPA.

    python experiments/cpu_attention.py --threads 2

Decode: one query per sequence, (batch, context) pairs; prints time and the K/V bandwidth achieved.
Prefill: one causal prompt (context = chunk) and a chunk after cached context, the reference against
the native decode kernel run once per query row (each row a sequence of its causal length): the
"read in place, row by row" way for prefill. Best of --repeats.
"""
from __future__ import annotations

import argparse

import torch

from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.native_decode_attention import decode_attention_native
from pdserve.kernels.prefill_attention import prefill_attention_ref
from pdserve.kernels.timing import best_seconds

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def paged(context_lens: list[int], dtype: torch.dtype):
    """A pool holding every sequence's blocks at shuffled ids, its tables and lengths (one layer)."""
    per_seq = [-(-n // BLOCK) for n in context_lens]
    pool = torch.randn(sum(per_seq) + 1, 1, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    ids = torch.randperm(pool.shape[0])
    tables = torch.zeros(len(context_lens), max(per_seq), dtype=torch.int32)
    used = 0
    for seq, count in enumerate(per_seq):
        tables[seq, :count] = ids[used:used + count]
        used += count
    return pool, tables, torch.tensor(context_lens, dtype=torch.int32)


def decode_rows(args, batch: int, context: int) -> str:
    pool, tables, lens = paged([context] * batch, args.dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(args.dtype)
    kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * pool.element_size()
    line = f"decode batch {batch:3} context {context:5}:"
    for name, fn in (("native", decode_attention_native), ("gather+SDPA", decode_attention_ref)):
        seconds = best_seconds(lambda: fn(q, pool, 0, tables, lens, HEAD_DIM ** -0.5), args.repeats)
        line += f"  {name} {seconds * 1e6:8.1f} us ({kv_bytes / seconds / 1e9:5.1f} GB/s)"
    return line


def prefill_rows(args, chunk: int, context: int) -> str:
    pool, tables, lens = paged([context], args.dtype)
    q = torch.randn(chunk, HEADS, HEAD_DIM).to(args.dtype)
    cu = torch.tensor([0, chunk], dtype=torch.int32)
    row_lens = torch.arange(context - chunk + 1, context + 1, dtype=torch.int32)
    row_tables = tables.expand(chunk, -1).contiguous()
    reference = best_seconds(lambda: prefill_attention_ref(q, pool, 0, cu, lens, tables, HEAD_DIM ** -0.5),
                             args.repeats)
    per_row = best_seconds(lambda: decode_attention_native(q, pool, 0, row_tables, row_lens, HEAD_DIM ** -0.5),
                           args.repeats)
    return (f"prefill chunk {chunk:5} after {context - chunk:5} cached:  gather+SDPA {reference * 1e3:8.2f} ms"
            f"  native row by row {per_row * 1e3:8.2f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--decode", default="1x192,1x1024,8x192,32x192,32x1024,16x4096")
    p.add_argument("--prefill", default="1024x1024,256x1024,128x4096")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        for pair in args.decode.split(","):
            print(decode_rows(args, *map(int, pair.split("x"))), flush=True)
        for pair in args.prefill.split(","):
            print(prefill_rows(args, *map(int, pair.split("x"))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
