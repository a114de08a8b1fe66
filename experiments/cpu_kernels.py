"""The native CPU kernels against the plain-torch paths, next to the machine's memory bandwidth.

    python experiments/cpu_kernels.py attention --threads 2 [--dtype bfloat16] [--prefill 256x1024] [--window 512]
    python experiments/cpu_kernels.py layers --model HF_DIR --dtype float32 --rows 1,8,32,512 --threads 2
    python experiments/cpu_kernels.py bandwidth --threads 2

attention: paged attention at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of
16), the native kernel that reads K/V in place against the reference that gathers them for SDPA. Decode:
one query per sequence, (batch, context) pairs, with the K/V bandwidth achieved. Prefill: one causal
chunk after cached context, the reference against the native decode kernel run once per query row.
--window: a sliding-window layer's attention (only the last N positions read; the bandwidth counts them).

layers: the dense part of every decoder layer in order (norms, projections, rotary, SiLU-and-mul;
attention left out) eager, through torch.compile (dynamic rows; its compile time too) and through the
native kernels: the time of one pass and the weight bandwidth achieved, per row count.

bandwidth: STREAM-like copy, triad and read (a batch-1 decode step's access pattern) over 256 MiB
arrays; `measure()` gives the ceiling other probes print beside their own figures. Best of --repeats.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

from pdserve.bench.documents import write_json
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.native_decode_attention import decode_attention_native
from pdserve.kernels.native_linear import linear_native
from pdserve.kernels.native_rms_norm import rms_norm_native
from pdserve.kernels.native_silu_and_mul import silu_and_mul_native
from pdserve.kernels.prefill_attention import prefill_attention_ref
from pdserve.kernels.rms_norm import rms_norm_ref
from pdserve.kernels.rotary import rotary_ref
from pdserve.kernels.timing import best_seconds

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
ARRAY_BYTES = 256 << 20


# attention

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
    kv_bytes = batch * min(context, args.window or context) * 2 * KV_HEADS * HEAD_DIM * pool.element_size()
    line = f"decode batch {batch:3} context {context:5}:"
    for name, fn in (("native", decode_attention_native), ("gather+SDPA", decode_attention_ref)):
        seconds = best_seconds(lambda: fn(q, pool, 0, tables, lens, HEAD_DIM ** -0.5, window=args.window),
                               args.repeats)
        line += f"  {name} {seconds * 1e6:8.1f} us ({kv_bytes / seconds / 1e9:5.1f} GB/s)"
    return line


def prefill_rows(args, chunk: int, context: int) -> str:
    pool, tables, lens = paged([context], args.dtype)
    q = torch.randn(chunk, HEADS, HEAD_DIM).to(args.dtype)
    cu = torch.tensor([0, chunk], dtype=torch.int32)
    row_lens = torch.arange(context - chunk + 1, context + 1, dtype=torch.int32)
    row_tables = tables.expand(chunk, -1).contiguous()
    scale, window = HEAD_DIM ** -0.5, args.window
    reference = best_seconds(lambda: prefill_attention_ref(q, pool, 0, cu, lens, tables, scale, window=window),
                             args.repeats)
    per_row = best_seconds(lambda: decode_attention_native(q, pool, 0, row_tables, row_lens, scale, window=window),
                           args.repeats)
    return (f"prefill chunk {chunk:5} after {context - chunk:5} cached:  gather+SDPA {reference * 1e3:8.2f} ms"
            f"  native row by row {per_row * 1e3:8.2f} ms")


def run_attention(args) -> int:
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        for pair in args.decode.split(","):
            print(decode_rows(args, *map(int, pair.split("x"))), flush=True)
        for pair in args.prefill.split(","):
            print(prefill_rows(args, *map(int, pair.split("x"))), flush=True)
    return 0


# layers

def dense_layers(model, h, residual, positions, ops):
    """One pass of the dense part of every layer with `ops` (linear, rms_norm, silu_and_mul)."""
    linear, rms_norm, silu_and_mul = ops
    attn0 = model.layers[0].self_attn
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h, residual = rms_norm(h, layer.input_norm.weight, layer.input_norm.eps, residual)
        q, k, _ = linear(h, attn.qkv_proj.weight, None).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, _ = rotary_ref(q.reshape(-1, attn0.num_heads, attn0.head_dim),
                          k.reshape(-1, attn0.num_kv_heads, attn0.head_dim), positions, model.cos_sin)
        h = linear(q.reshape(-1, attn.q_size), attn.o_proj.weight, None)
        h, residual = rms_norm(h, layer.pre_mlp_norm.weight, layer.pre_mlp_norm.eps, residual)
        h = linear(silu_and_mul(linear(h, mlp.gate_up_proj.weight, None)), mlp.down_proj.weight, None)
    return h, residual


EAGER = (F.linear, rms_norm_ref, silu_and_mul_ref)
NATIVE = (lambda x, w, b: linear_native(x, w), rms_norm_native, silu_and_mul_native)


def layers_line(model, hidden: int, rows: int, dtype, compiled, weight_bytes: int, repeats: int) -> str:
    h = torch.randn(rows, hidden).to(dtype)
    residual, positions = torch.randn_like(h), torch.arange(rows)
    line = f"rows {rows:4}:"
    for name, fn in (("eager", lambda: dense_layers(model, h, residual, positions, EAGER)),
                     ("native", lambda: dense_layers(model, h, residual, positions, NATIVE)),
                     ("compiled", compiled and (lambda: compiled(model, h, residual, positions)))):
        if fn is None:
            continue
        if name == "compiled":
            torch._dynamo.mark_dynamic(h, 0)
            line += f"  compile {best_seconds(fn, 1):6.1f} s"
        fn()
        seconds = best_seconds(fn, repeats)
        line += f"  {name} {seconds * 1e3:8.2f} ms ({weight_bytes / seconds / 1e9:5.1f} GB/s)"
    return line


def run_layers(args) -> int:
    from pdserve.engine.config import DTYPES, ModelConfig
    from pdserve.engine.model.resolve import resolve_model
    from pdserve.engine.worker.model_runner import load_model

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))  # NOTE: a cold compile
    config = ModelConfig.from_dir(resolve_model(args.model).path)
    model = load_model(config, DTYPES[args.dtype], torch.device("cpu"), 4096)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if name.startswith("layers.") and p.dim() == 2)
    compiled = None if args.no_compile else torch.compile(lambda *a: dense_layers(*a, EAGER), dynamic=True)
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            line = layers_line(model, config.hidden_size, rows, DTYPES[args.dtype], compiled, weight_bytes, args.repeats)
            print(line, flush=True)
    return 0


# bandwidth

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


def run_bandwidth(args) -> int:
    result = measure(args.threads, args.repeats)
    print(f"memory bandwidth, {result['threads']} threads: copy {result['copy_gb_s']:.1f} GB/s, "
          f"triad {result['triad_gb_s']:.1f} GB/s, read {result['read_gb_s']:.1f} GB/s")
    if args.result_json:
        write_json(args.result_json, result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    p = probes.add_parser("attention", help="paged attention: native in place against gather + SDPA")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--decode", default="1x192,1x1024,8x192,32x192,32x1024,16x4096")
    p.add_argument("--prefill", default="1024x1024,256x1024,128x4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--window", type=int, default=0, help="a sliding window of this many positions (0: none)")
    p.set_defaults(run=run_attention)
    p = probes.add_parser("layers", help="a model's dense layers: eager, torch.compile, native")
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rows", default="1,8,32,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes a while)")
    p.set_defaults(run=run_layers)
    p = probes.add_parser("bandwidth", help="STREAM-like memory bandwidth")
    p.add_argument("--threads", type=int, default=None, help="default: every core this process may use")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-json", default=None)
    p.set_defaults(run=run_bandwidth)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
