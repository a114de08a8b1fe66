"""Hybrid GGUF files: Qwen3-Next (`qwen3next`), Qwen3.5 (`qwen35`) and Qwen3.5-MoE (`qwen35moe`), whose
Gated DeltaNet layers llama.cpp stores as `ssm_*` tensors, read back into the Hugging Face checkpoint's names
and layout (Qwen3-Next's and Qwen3.5-MoE's experts: gguf_experts.py).

Metadata: `ssm.group_count` key heads of `ssm.state_size`, `ssm.time_step_rank` value heads sharing
`ssm.inner_size`, `ssm.conv_kernel`; the linear-attention layers are those `attention.recurrent_layers`
marks (it lists the MTP blocks too), else all but every `full_attention_interval`-th, as llama.cpp reads them.
Qwen3.5's and Qwen3.5-MoE's `rope.dimension_sections` (multimodal rotary sections) are not read: a text-only
prompt gives every section the same position, which is plain rotary embedding.

What llama.cpp's converter changed, undone here (`TensorSpec.undo`):
- `ssm_a` holds A = -exp(A_log): A_log is its log (float32, so within rounding of the checkpoint's);
- `ssm_conv1d` is conv1d.weight without its middle dimension of 1;
- Qwen3-Next's in_proj_qkvz (each key head's q, k, its value heads' v, then z) is split into `attn_qkv`
  (every q, every k, every v) and `attn_gate` (every z), which are regrouped (older files hold it
  whole as `ssm_in`); its in_proj_ba is `ssm_ba` as it was;
- Qwen3.5 and Qwen3.5-MoE order value heads tiled over the key heads (k0's first, k1's first, ..., k0's
  second, ...) instead of grouped by key head, in in_proj_qkv's v rows, in_proj_z, in_proj_b / in_proj_a
  (`ssm_beta`, `ssm_alpha`), A_log, dt_bias, conv1d's v channels and out_proj's columns.
The zero-centred norms (stored as 1 + weight) are gguf_tensors' offsets; the gated norm `ssm_norm` is not one.
A full-attention layer's `attn_q` holds each head's query, then its output gate, as q_proj does.
"""
from __future__ import annotations

from functools import partial

import torch

from pdserve.engine.model.recurrent_config import LINEAR, LinearAttentionConfig
from pdserve.engine.model.weights import grouped_projection_rows

HYBRID = ("qwen3next", "qwen35", "qwen35moe")
TILED_V_HEADS = ("qwen35", "qwen35moe")
FULL_ATTENTION_INTERVAL = 4                  # llama.cpp's default


def recurrent_layers(f, n: int) -> list[bool]:
    """Which of the `n` served layers are linear attention (none outside the hybrid families)."""
    if f.architecture not in HYBRID:
        return [False] * n
    key = f.arch("attention.recurrent_layers")
    flags = f.value(key)
    if flags is None:
        interval_key = f.arch("full_attention_interval")
        interval = f.integer(interval_key, FULL_ATTENTION_INTERVAL)
        if interval < 1:
            raise f.error(f"{interval_key} = {interval} must be positive")
        return [(i + 1) % interval != 0 for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or not all(isinstance(x, bool) for x in flags):
        raise f.error(f"{key} must mark each of the {n} layers recurrent or not, got {flags!r}")
    return flags[:n]


def linear_attention(f) -> LinearAttentionConfig:
    """The Gated DeltaNet layers' heads and convolution, from the ssm.* keys."""
    a = f.arch
    value_heads, inner = f.integer(a("ssm.time_step_rank")), f.integer(a("ssm.inner_size"))
    if value_heads <= 0 or inner % value_heads:
        raise f.error(f"{a('ssm.inner_size')} = {inner} is not a multiple of {a('ssm.time_step_rank')} = "
                      f"{value_heads} (the value heads)")
    la = LinearAttentionConfig(num_k_heads=f.integer(a("ssm.group_count")), num_v_heads=value_heads,
                               k_head_dim=f.integer(a("ssm.state_size")), v_head_dim=inner // value_heads,
                               conv_kernel=f.integer(a("ssm.conv_kernel")))
    if la.num_k_heads <= 0 or la.num_v_heads % la.num_k_heads or la.conv_kernel < 2:
        raise f.error(f"{a('ssm.time_step_rank')} = {value_heads} must be a multiple of {a('ssm.group_count')} = "
                      f"{la.num_k_heads}, and {a('ssm.conv_kernel')} = {la.conv_kernel} at least 2")
    return la


def hybrid_config(f, n: int) -> dict:
    """config.json's linear-attention keys and layer types."""
    la = linear_attention(f)
    return {"linear_num_key_heads": la.num_k_heads, "linear_num_value_heads": la.num_v_heads,
            "linear_key_head_dim": la.k_head_dim, "linear_value_head_dim": la.v_head_dim,
            "linear_conv_kernel_dim": la.conv_kernel, "attention_bias": False,
            "layer_types": [LINEAR if r else "full_attention" for r in recurrent_layers(f, n)]}


def linear_attention_tensors(f, hidden: int, i: int) -> dict[str, tuple[str, tuple[int, ...], str, dict]]:
    """Layer i's Gated DeltaNet tensors: GGUF name -> (Hugging Face name, shape in the file, the keys the shape
    comes from, TensorSpec options)."""
    a, la, m = f.arch, linear_attention(f), f"model.layers.{i}.linear_attn"
    keys = f"{a('ssm.group_count')}, {a('ssm.state_size')}, {a('ssm.inner_size')}, {a('embedding_length')}"
    heads_keys = a("ssm.time_step_rank")
    heads, tiled = la.num_v_heads, f.architecture in TILED_V_HEADS
    per_head = _grouped(la, 1) if tiled else None
    channels = torch.cat([torch.arange(2 * la.key_dim), 2 * la.key_dim + _grouped(la, la.v_head_dim)])
    specs = {
        "ssm_a": (f"{m}.A_log", (heads,), heads_keys, {"undo": (_log_of_negated, *_select(per_head))}),
        "ssm_dt.bias": (f"{m}.dt_bias", (heads,), heads_keys, {"undo": _select(per_head)}),
        "ssm_conv1d.weight": (f"{m}.conv1d.weight", (la.conv_dim, la.conv_kernel), f"{keys}, {a('ssm.conv_kernel')}",
                              {"undo": (*_select(channels if tiled else None), _middle_dimension)}),
        "ssm_norm.weight": (f"{m}.norm.weight", (la.v_head_dim,), keys, {}),
        "ssm_out.weight": (f"{m}.out_proj.weight", (hidden, la.value_dim), keys,
                           {"undo": _select(_grouped(la, la.v_head_dim) if tiled else None, dim=1)}),
    }
    if tiled:
        return specs | {
            "attn_qkv.weight": (f"{m}.in_proj_qkv.weight", (la.conv_dim, hidden), keys, {"undo": _select(channels)}),
            "attn_gate.weight": (f"{m}.in_proj_z.weight", (la.value_dim, hidden), keys,
                                 {"undo": _select(_grouped(la, la.v_head_dim))}),
            "ssm_beta.weight": (f"{m}.in_proj_b.weight", (heads, hidden), heads_keys, {"undo": _select(per_head)}),
            "ssm_alpha.weight": (f"{m}.in_proj_a.weight", (heads, hidden), heads_keys, {"undo": _select(per_head)})}
    specs["ssm_ba.weight"] = (f"{m}.in_proj_ba.weight", (2 * heads, hidden), heads_keys, {})
    qkvz = (f"{m}.in_proj_qkvz.weight", la.conv_dim + la.value_dim)
    if f"blk.{i}.ssm_in.weight" in f.tensors:                            # as older converters wrote it
        return specs | {"ssm_in.weight": (qkvz[0], (qkvz[1], hidden), keys, {})}
    regroup = {"concatenated": True, "undo": _select(torch.argsort(grouped_projection_rows(la)[0]))}
    return specs | {"attn_qkv.weight": (qkvz[0], (la.conv_dim, hidden), keys, {"part": (0, 2), **regroup}),
                    "attn_gate.weight": (qkvz[0], (la.value_dim, hidden), keys, {"part": (1, 2), **regroup})}


def _grouped(la: LinearAttentionConfig, head_size: int) -> torch.Tensor:
    """The file row of each checkpoint row of a per-value-head tensor (`head_size` rows a head) whose value heads
    the converter turned from grouped by key head into tiled."""
    ratio = la.num_v_heads // la.num_k_heads
    tiled = torch.arange(la.num_v_heads * head_size).reshape(ratio, la.num_k_heads, head_size)
    return tiled.transpose(0, 1).reshape(-1)


def _select(index: torch.Tensor | None, dim: int = 0) -> tuple:
    """The undo step taking rows (dim 0) or columns (dim 1) in `index`'s order; none for None."""
    return () if index is None else (partial(_index_select, dim=dim, index=index),)


def _index_select(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    return t.index_select(dim, index)


def _log_of_negated(t: torch.Tensor) -> torch.Tensor:
    return torch.log(-t.float())


def _middle_dimension(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1)
