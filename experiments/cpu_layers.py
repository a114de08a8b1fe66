"""The dense part of a decoder layer on CPU three ways: eager torch, torch.compile, the native kernels.

    python experiments/cpu_layers.py --model HF_DIR --dtype float32 --rows 1,8,32,512 --threads 2

For every layer of the model, in order (so the weights stream from memory as in a real step):
residual add + RMSNorm, the QKV projection, rotary of q and k, the output projection (of q, to
keep the shapes), residual add + RMSNorm, gate/up projection, SiLU-and-mul, down projection.
Attention itself is left out (bench/kernel_bench.py and bench.profile_step measure it). Prints, per
row count, the time of one pass over all layers and the achieved weight bandwidth; for
torch.compile also the compile time of the first call and of each new row count (dynamic shapes:
`mark_dynamic` on the row dimension, so one graph should serve every count).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

from pdserve.engine.config import DTYPES, ModelConfig
from pdserve.engine.topology import resolve_model_dir
from pdserve.engine.worker.model_runner import load_model
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.native_linear import linear_native
from pdserve.kernels.native_rms_norm import rms_norm_native
from pdserve.kernels.native_silu_and_mul import silu_and_mul_native
from pdserve.kernels.rms_norm import rms_norm_ref
from pdserve.kernels.rotary import rotary_ref
from pdserve.kernels.timing import best_seconds


def dense_layers(model, h, residual, positions, ops):
    """One pass of the dense part of every layer with `ops` (linear, rms_norm, silu_and_mul)."""
    linear, rms_norm, silu_and_mul = ops
    attn0 = model.layers[0].self_attn
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h, residual = rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps, residual)
        q, k, _ = linear(h, attn.qkv_proj.weight, None).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, _ = rotary_ref(q.reshape(-1, attn0.num_heads, attn0.head_dim),
                          k.reshape(-1, attn0.num_kv_heads, attn0.head_dim), positions, model.cos_sin)
        h = linear(q.reshape(-1, attn.q_size), attn.o_proj.weight, None)
        h, residual = rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, residual)
        h = linear(silu_and_mul(linear(h, mlp.gate_up_proj.weight, None)), mlp.down_proj.weight, None)
    return h, residual


EAGER = (F.linear, rms_norm_ref, silu_and_mul_ref)
NATIVE = (lambda x, w, b: linear_native(x, w), rms_norm_native, silu_and_mul_native)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo:base")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rows", default="1,8,32,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes a while)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))  # NOTE: a cold compile
    config = ModelConfig.from_dir(resolve_model_dir(args.model))
    model = load_model(config, DTYPES[args.dtype], torch.device("cpu"), 4096)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if name.startswith("layers.") and p.dim() == 2)
    compiled = None if args.no_compile else torch.compile(lambda *a: dense_layers(*a, EAGER), dynamic=True)
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            h = torch.randn(rows, config.hidden_size).to(DTYPES[args.dtype])
            residual, positions = torch.randn_like(h), torch.arange(rows)
            line = f"rows {rows:4}:"
            for name, fn in (("eager", lambda: dense_layers(model, h, residual, positions, EAGER)),
                             ("native", lambda: dense_layers(model, h, residual, positions, NATIVE)),
                             ("compiled", compiled and (lambda: compiled(model, h, residual, positions)))):
                if fn is None:
                    continue
                if name == "compiled":
                    torch._dynamo.mark_dynamic(h, 0)
                    first = best_seconds(fn, 1)
                    line += f"  compile {first:6.1f} s"
                fn()
                seconds = best_seconds(fn, args.repeats)
                line += f"  {name} {seconds * 1e3:8.2f} ms ({weight_bytes / seconds / 1e9:5.1f} GB/s)"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
