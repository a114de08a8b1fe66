"""Gemma 4's checkpoint names beside the other families' (weights.py): its per-layer inputs and output scalars,
and in a layer with experts (26B-A4B) the router, the stacked experts and their norms beside the dense MLP."""
from __future__ import annotations

from pdserve.engine.model.destination import Destination

PER_LAYER_INPUTS = {"embedding": "embed_tokens_per_layer", "projection": "per_layer_model_projection",
                    "norm": "per_layer_projection_norm"}
PER_LAYER_INPUT = {"gate": "per_layer_input_gate", "projection": "per_layer_projection",
                   "norm": "post_per_layer_input_norm"}
EXPERT_NORMS = {"dense_output_norm": "post_feedforward_layernorm_1",
                "experts_input_norm": "pre_feedforward_layernorm_2",
                "experts_output_norm": "post_feedforward_layernorm_2"}


def model_names(c) -> dict[str, Destination]:
    if not c.per_layer_input_size:
        return {}
    return {f"model.{theirs}.weight": Destination(f"per_layer_inputs.{ours}.weight")
            for ours, theirs in PER_LAYER_INPUTS.items()}


def layer_names(c, i: int, mlp: dict[str, Destination]) -> dict[str, Destination]:
    """Layer i's MLP (`mlp`: the dense one's names, as any family's), experts, per-layer input and scalar."""
    names = {}
    if c.per_layer_input_size:
        names |= {f"model.layers.{i}.{theirs}.weight": Destination(f"layers.{i}.per_layer_input.{ours}.weight")
                  for ours, theirs in PER_LAYER_INPUT.items()}
    if c.layer_scalars:
        names[f"model.layers.{i}.layer_scalar"] = Destination(f"layers.{i}.layer_scalar")
    if not c.layer_kinds[i].experts:
        return names | mlp
    ours, theirs = f"layers.{i}.mlp", f"model.layers.{i}"
    dense = {name: Destination(dest.param.replace(f"{ours}.", f"{ours}.dense.", 1), dest.start, dest.stop)
             for name, dest in mlp.items()}
    return names | dense | {
        f"{theirs}.router.proj.weight": Destination(f"{ours}.router.weight"),
        f"{theirs}.router.scale": Destination(f"{ours}.router.scale"),
        f"{theirs}.router.per_expert_scale": Destination(f"{ours}.router.expert_scale"),
        f"{theirs}.experts.gate_up_proj": Destination(f"{ours}.w13"),
        f"{theirs}.experts.down_proj": Destination(f"{ours}.w2"),
        **{f"{theirs}.{norm}.weight": Destination(f"{ours}.{mine}.weight") for mine, norm in EXPERT_NORMS.items()}}
