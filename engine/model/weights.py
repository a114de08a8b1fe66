"""Load Hugging Face safetensors straight into the model's (empty) parameters.

Each checkpoint tensor is read from its memory-mapped file and copied into its
destination (a slice of a fused parameter where q/k/v or gate/up are fused, one
expert of a layer's stacked experts), so the peak is the model plus one tensor,
never a second full copy.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model import weights_gemma4
from pdserve.engine.model.destination import Destination
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.rope import rotary_order
from pdserve.engine.model.text_of_multimodal import text_name


class WeightError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class CheckpointFiles(dict):
    """Every tensor name, as the causal LM names it, -> the safetensors file holding it; `stored` the name in
    that file (a multimodal checkpoint prefixes its language model's, `text_of_multimodal`)."""

    def __init__(self, stored_files: dict[str, Path]) -> None:
        super().__init__()
        self.stored: dict[str, str] = {}
        for stored, path in stored_files.items():
            name = text_name(stored)
            if name is not None:
                self[name], self.stored[name] = path, stored


def checkpoint_files(model_dir: Path) -> CheckpointFiles:
    """Map every tensor name the model may read to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightError(f"{index}: malformed index: {e}") from None
        return CheckpointFiles({name: model_dir / file for name, file in weight_map.items()})
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise WeightError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return CheckpointFiles({name: single for name in f.keys()})


def destinations(model: CausalLM, fused: bool = False) -> dict[str, Destination]:
    """Every checkpoint tensor name the model expects, and where it goes; `fused`: the checkpoint stores
    qkv_proj and gate_up_proj as one tensor each (Phi-3), as the model does."""
    c = model.config
    offset = c.norm_offset
    names = {"model.embed_tokens.weight": Destination("embed_tokens.weight"),
             "model.norm.weight": Destination("norm.weight", offset=offset)}
    if model.lm_head is not None:
        names["lm_head.weight"] = Destination("lm_head.weight")
    for i in range(c.num_layers):
        mixer = _linear_attention(c, i) if c.layer_kinds[i].recurrent else _attention(c, i, fused)
        if c.architecture == "gemma4":
            names |= weights_gemma4.layer_names(c, i, _mlp(c, i, fused))
        else:
            names |= _experts(c, i) if c.layer_kinds[i].experts else _mlp(c, i, fused)
        names |= mixer
        for ours, theirs in _norm_names(c).items():
            names[f"model.layers.{i}.{theirs}.weight"] = Destination(f"layers.{i}.{ours}.weight", offset=offset)
    if c.architecture == "gemma4":
        names |= weights_gemma4.model_names(c)
    return names


def _attention(c, i: int, fused: bool) -> dict[str, Destination]:
    attn, kind = f"layers.{i}.self_attn", c.layer_kinds[i]
    hd = c.layer_head_dim(i)
    q, kv = c.num_heads * hd, c.layer_kv_heads(i) * hd
    order = qkv_rows(c, i)
    names = {}
    for bias in ["weight", "bias"] if c.attention_bias else ["weight"]:
        if c.attention_output_gate:
            names |= _gated_qkv(c, i, bias)
            continue
        if fused:
            names[f"model.{attn}.qkv_proj.{bias}"] = Destination(f"{attn}.qkv_proj.{bias}", rows=order)
            continue
        part = (lambda lo, hi: None if order is None else order[lo:hi] - lo)
        names[f"model.{attn}.q_proj.{bias}"] = Destination(f"{attn}.qkv_proj.{bias}", 0, q, part(0, q))
        if kind.reuses_kv:                                   # Gemma 4: an earlier layer's K and V
            continue
        names[f"model.{attn}.k_proj.{bias}"] = Destination(f"{attn}.qkv_proj.{bias}", q, q + kv, part(q, q + kv))
        if not (c.full_keys_as_values and not kind.window):
            names[f"model.{attn}.v_proj.{bias}"] = Destination(f"{attn}.qkv_proj.{bias}", q + kv, q + 2 * kv)
    names[f"model.{attn}.o_proj.weight"] = Destination(f"{attn}.o_proj.weight")
    if c.o_proj_bias:
        names[f"model.{attn}.o_proj.bias"] = Destination(f"{attn}.o_proj.bias")
    if c.qk_norm:
        head = None if order is None else order[:hd]
        for norm in ("q_norm",) if kind.reuses_kv else ("q_norm", "k_norm"):
            names[f"model.{attn}.{norm}.weight"] = Destination(f"{attn}.{norm}.weight", rows=head,
                                                               offset=c.norm_offset)
    if c.attention_sinks:
        names[f"model.{attn}.sinks"] = Destination(f"{attn}.sinks")
    return names


def _linear_attention(c, i: int) -> dict[str, Destination]:
    """A Gated DeltaNet layer: its input projections into one [q | k | v | z | b | a] (Qwen3-Next's in_proj_qkvz and
    in_proj_ba interleave them per key head group; Qwen3.5's are four), the convolution, decay, norm and output."""
    la, ours, theirs = c.linear_attention, f"layers.{i}.linear_attn", f"model.layers.{i}.linear_attn"
    qkvz, heads = la.conv_dim + la.value_dim, la.num_v_heads
    names = {f"{theirs}.conv1d.weight": Destination(f"{ours}.conv_weight"),
             f"{theirs}.dt_bias": Destination(f"{ours}.dt_bias"), f"{theirs}.A_log": Destination(f"{ours}.a_log"),
             f"{theirs}.norm.weight": Destination(f"{ours}.norm_weight"),
             f"{theirs}.out_proj.weight": Destination(f"{ours}.out_proj.weight")}
    projection = f"{ours}.in_proj.weight"
    if c.architecture == "qwen3_next":
        qkvz_rows, ba_rows = grouped_projection_rows(la)
        return names | {f"{theirs}.in_proj_qkvz.weight": Destination(projection, 0, qkvz, qkvz_rows),
                        f"{theirs}.in_proj_ba.weight": Destination(projection, qkvz, qkvz + 2 * heads, ba_rows)}
    return names | {f"{theirs}.in_proj_qkv.weight": Destination(projection, 0, la.conv_dim),
                    f"{theirs}.in_proj_z.weight": Destination(projection, la.conv_dim, qkvz),
                    f"{theirs}.in_proj_b.weight": Destination(projection, qkvz, qkvz + heads),
                    f"{theirs}.in_proj_a.weight": Destination(projection, qkvz + heads, qkvz + 2 * heads)}


def grouped_projection_rows(la) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint rows of [q | k | v | z] and [b | a] in Qwen3-Next's in_proj_qkvz and in_proj_ba, which hold each
    key head's q, k, then its value heads' v and z (and their b, a) together."""
    ratio, dk = la.num_v_heads // la.num_k_heads, la.k_head_dim
    width = ratio * la.v_head_dim
    group = torch.arange(la.num_k_heads)[:, None] * (2 * dk + 2 * width)
    parts = [(0, dk), (dk, dk), (2 * dk, width), (2 * dk + width, width)]
    qkvz = torch.cat([(group + start + torch.arange(n)).reshape(-1) for start, n in parts])
    pairs = torch.arange(la.num_k_heads)[:, None] * 2 * ratio
    ba = torch.cat([(pairs + torch.arange(ratio)).reshape(-1), (pairs + ratio + torch.arange(ratio)).reshape(-1)])
    return qkvz, ba


def _gated_qkv(c, i: int, kind: str) -> dict[str, Destination]:
    """q_proj holds each head's query, then its output gate (Qwen3-Next): the model stores every query, then every
    gate, then k and v (q and k rows in rotary order)."""
    q, kv, attn = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, f"layers.{i}.self_attn"
    rows, fused = fused_qkv_rows(c, i), f"{attn}.qkv_proj.{kind}"
    return {f"model.{attn}.q_proj.{kind}": Destination(fused, 0, 2 * q, rows[:2 * q]),
            f"model.{attn}.k_proj.{kind}": Destination(fused, 2 * q, 2 * q + kv, rows[2 * q:2 * q + kv] - 2 * q),
            f"model.{attn}.v_proj.{kind}": Destination(fused, 2 * q + kv, 2 * q + 2 * kv)}


def fused_qkv_rows(c, i: int) -> torch.Tensor | None:
    """Layer i's qkv_proj rows in the order the model stores them, as rows of the checkpoint's q, k and v
    projections one after another (its q_proj with the output gates, where there are any), or None when that is
    the checkpoint's order."""
    order = qkv_rows(c, i)
    if not c.attention_output_gate:
        return order
    q, kv, hd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
    dims = torch.arange(hd) if order is None else order[:hd]
    heads = torch.arange(c.num_heads)[:, None] * 2 * hd
    keys = torch.arange(q, q + kv) if order is None else order[q:q + kv]
    return torch.cat([(heads + dims).reshape(-1), (heads + hd + torch.arange(hd)).reshape(-1),
                      q + keys, torch.arange(2 * q + kv, 2 * q + 2 * kv)])


def qkv_rows(c, i: int) -> torch.Tensor | None:
    """Layer i's fused q/k/v rows in the order the model stores them (rope.rotary_order per q and k head: the
    checkpoint row of each of the model's rows), or None when that is the checkpoint's order."""
    rope, hd = c.layer_kinds[i].rope, c.layer_head_dim(i)
    order = None if rope is None else rotary_order(hd, rope.rotary_dim(hd))
    if order is None:
        return None
    q, kv = c.num_heads * hd, c.layer_kv_heads(i) * hd
    heads = torch.arange(c.num_heads + c.layer_kv_heads(i))[:, None] * hd + order[None, :]
    return torch.cat([heads.reshape(-1), torch.arange(q + kv, q + 2 * kv)])


def _mlp(c, i: int, fused: bool) -> dict[str, Destination]:
    mlp, inter = f"layers.{i}.mlp", c.layer_kinds[i].intermediate_size or c.intermediate_size
    names = {f"model.{mlp}.down_proj.weight": Destination(f"{mlp}.down_proj.weight")}
    if fused:
        return names | {f"model.{mlp}.gate_up_proj.weight": Destination(f"{mlp}.gate_up_proj.weight")}
    return names | {f"model.{mlp}.gate_proj.weight": Destination(f"{mlp}.gate_up_proj.weight", 0, inter),
                    f"model.{mlp}.up_proj.weight": Destination(f"{mlp}.gate_up_proj.weight", inter, 2 * inter)}


def _experts(c, i: int) -> dict[str, Destination]:
    """A mixture-of-experts layer: gpt-oss's stacked experts (gate and up interleaved, [in, out]), else one
    gate, up and down tensor per expert (Mixtral's w1, w3, w2), the router and Qwen2-MoE's shared expert."""
    e, ours = c.experts, f"layers.{i}.mlp"
    if c.architecture == "gpt_oss":
        theirs, width = f"model.layers.{i}.mlp", 2 * e.intermediate_size
        deinterleave = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])   # gate rows, up rows
        return {f"{theirs}.router.weight": Destination(f"{ours}.router.weight"),
                f"{theirs}.router.bias": Destination(f"{ours}.router.bias"),
                f"{theirs}.experts.gate_up_proj": Destination(f"{ours}.w13", rows=deinterleave, transposed=True,
                                                              rows_dim=1),
                f"{theirs}.experts.gate_up_proj_bias": Destination(f"{ours}.b13", rows=deinterleave, rows_dim=1),
                f"{theirs}.experts.down_proj": Destination(f"{ours}.w2", transposed=True),
                f"{theirs}.experts.down_proj_bias": Destination(f"{ours}.b2")}
    mixtral = c.architecture == "mixtral"
    theirs = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    inter = e.intermediate_size
    names = {f"{theirs}.gate.weight": Destination(f"{ours}.router.weight")}
    for x in range(e.num_experts):
        expert = f"{theirs}.experts.{x}"
        names |= {f"{expert}.{gate}.weight": Destination(f"{ours}.w13", 0, inter, expert=x),
                  f"{expert}.{up}.weight": Destination(f"{ours}.w13", inter, 2 * inter, expert=x),
                  f"{expert}.{down}.weight": Destination(f"{ours}.w2", expert=x)}
    if e.shared_intermediate_size:
        shared, size = f"{ours}.shared_expert", e.shared_intermediate_size
        names |= {f"{theirs}.shared_expert.gate_proj.weight": Destination(f"{shared}.gate_up_proj.weight", 0, size),
                  f"{theirs}.shared_expert.up_proj.weight": Destination(f"{shared}.gate_up_proj.weight", size,
                                                                         2 * size),
                  f"{theirs}.shared_expert.down_proj.weight": Destination(f"{shared}.down_proj.weight")}
    if e.shared_gate:
        names[f"{theirs}.shared_expert_gate.weight"] = Destination(f"{ours}.shared_gate")
    return names


def _norm_names(c) -> dict[str, str]:
    """The model's norms and the checkpoint's names for them (Gemma's post_attention_layernorm is the
    attention's output norm; Llama's is the MLP's input norm)."""
    if c.sandwich_norms:
        return {"input_norm": "input_layernorm", "attention_output_norm": "post_attention_layernorm",
                "pre_mlp_norm": "pre_feedforward_layernorm", "mlp_output_norm": "post_feedforward_layernorm"}
    return {"input_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}


def load_weights(model: CausalLM, model_dir: str | Path, skip: frozenset[str] = frozenset()) -> None:
    """Fill every parameter of `model` but those named in `skip` (held otherwise: GGUF blocks); raises
    WeightError naming the tensor and file on any mismatch."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    everything = destinations(model, fused="model.layers.0.self_attn.qkv_proj.weight" in files)
    expected = {name: dest for name, dest in everything.items() if dest.param not in skip}
    tied_head = model.lm_head is None and "lm_head.weight" in files
    unexpected = sorted(n for n in files if n not in everything and not IGNORED.match(n)
                        and not (tied_head and n == "lm_head.weight"))
    if unexpected:
        raise WeightError(f"{model_dir}: unexpected tensors for {model.config.architecture}: "
                          f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    missing = sorted(n for n in expected if n not in files)
    if missing:
        raise WeightError(f"{model_dir}: missing tensors: {', '.join(missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''}")
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    _copy_tensor(f.get_tensor(files.stored[name]), params, expected[name], name, path)


def _copy_tensor(tensor: torch.Tensor, params: dict, dest: Destination, name: str, path: Path) -> None:
    target = params[dest.param]
    if dest.expert is not None:
        target = target[dest.expert]
    if dest.start is not None:
        target = target[dest.start:dest.stop]
    if dest.transposed:
        tensor = tensor.transpose(-1, -2)
    if tuple(tensor.shape) != tuple(target.shape):
        raise WeightError(f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                          f"expected {tuple(target.shape)}")
    if dest.rows is not None:
        tensor = tensor.index_select(dest.rows_dim, dest.rows)
    target.copy_(tensor.float() + dest.offset if dest.offset else tensor)
