"""How far a model computing from GGUF blocks may be from transformers on the dequantized weights.

pdserve's GGUF kernels (like llama.cpp's) round a projection's input per block before the integer dot
product: q8 (d = amax / 127 per 32 values) against 32-weight blocks, q8_K (per 256) against the K types,
none against F32 / F16 / BF16 rows. That rounding is discontinuous, so once one value rounds the other
way (a float32 sum in another order suffices) every later rounding can differ: two implementations that
both quantize diverge by as much as quantizing moves either one. The bound is therefore measured on the
reference itself: transformers' model (its GGUF loader's dequantized weights) run in float64 once as it
is and once with `quantizing_activations` (the kernels' rounding in front of every nn.Linear, each for
its GGUF weight type); at each position pdserve's float32 logits must lie within SLACK times that
displacement (its largest over the vocabulary), plus tests/tolerance.py's float32 bound, of the exact
float64 logits. Greedy tokens must equal the exact reference's argmax wherever its top-2 margin exceeds
twice the bound.
"""
from __future__ import annotations

import contextlib

import gguf
import torch

from tests.tolerance import SLACK, float32_error_bound

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
BLOCK = {t.name: gguf.GGML_QUANT_SIZES[t][0] for t in gguf.GGMLQuantizationType}


def quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded per `block` values of its last dimension: q8 (block 32) or q8_K (256), as the kernels do."""
    if block == 1:
        return x
    blocks = x.reshape(*x.shape[:-1], -1, block)
    if block == 32:
        scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    else:
        at = blocks.abs().argmax(dim=-1, keepdim=True)
        scale = -blocks.gather(-1, at) / 127                   # q8_K: d = max / -127 (its sign is irrelevant)
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    q = torch.round(blocks * inverse).clamp(-127, 127)        # NOTE: torch.round: half to even, as the kernels
    return (q * scale).reshape(x.shape)


def gguf_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def projection_types(model: torch.nn.Module, types: dict[str, str]) -> dict[str, str]:
    """Each nn.Linear of the transformers model -> the GGUF type of its weight."""
    tied = model.config.tie_word_embeddings
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name == "lm_head":
            found[name] = types["token_embd.weight" if tied else "output.weight"]
            continue
        _, _, layer, rest = name.split(".", 3)
        found[name] = types[f"blk.{layer}.{HF_TO_GGUF[rest]}.weight"]
    return found


@contextlib.contextmanager
def quantizing_activations(model: torch.nn.Module, types: dict[str, str]):
    """Within the block, every nn.Linear of `model` quantizes its input for its GGUF weight type."""
    handles = []
    for name, kind in projection_types(model, types).items():
        block = BLOCK[kind] if kind not in ("F32", "F16", "BF16") else 1
        hook = (lambda block: lambda module, args: (quantize(args[0], block),))(block)
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


class Reference:
    """transformers' model of the dequantized weights in float32 and float64, and the GGUF's types."""

    def __init__(self, model32, model64, types: dict[str, str]) -> None:
        self.model32, self.model64, self.types = model32, model64, types

    def logits(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact float64 logits [T, V], bound [T]): per position, the largest difference from them the
        activation quantization may make (module docstring)."""
        batch = torch.tensor([ids])
        with torch.no_grad():
            exact32, exact64 = self.model32(batch).logits[0], self.model64(batch).logits[0]
            with quantizing_activations(self.model64, self.types):
                quantized64 = self.model64(batch).logits[0]
        moved = (quantized64 - exact64).abs().amax(dim=-1)
        return exact64, SLACK * moved + float32_error_bound(exact32, exact64)

    def assert_logits_close(self, ours: torch.Tensor, ids: list[int]) -> None:
        exact64, bound = self.logits(ids)
        excess = (ours.double() - exact64).abs().amax(dim=-1) - bound
        assert (excess <= 0).all(), f"a position's logits exceed their bound by {excess.max().item():.3g}"

    def assert_generation_close(self, output, prompt: list[int]) -> int:
        """A greedy generation against the exact reference, teacher-forced on its tokens: each token the
        argmax where the top-2 margin exceeds twice the bound, each log-probability within twice the bound
        (a log-softmax moves by at most twice its logits' largest move). Returns the decided steps."""
        tokens = list(output.token_ids)
        exact64, bound = self.logits(prompt + tokens)
        steps, bound = exact64[len(prompt) - 1:-1], bound[len(prompt) - 1:-1]
        top = steps.topk(2, dim=-1)
        decided = (top.values[:, 0] - top.values[:, 1]) > 2 * bound
        wrong = [(i, t, int(top.indices[i, 0])) for i, t in enumerate(tokens)
                 if decided[i] and t != int(top.indices[i, 0])]
        assert not wrong, f"greedy tokens differ where the margin exceeds twice the bound: {wrong[:4]}"
        if output.logprobs:
            expected = torch.log_softmax(steps, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            ours = torch.tensor([lp.logprob for lp in output.logprobs], dtype=torch.float64)
            excess = (ours - expected).abs() - 2 * bound
            assert (excess <= 0).all(), f"a log-probability exceeds its bound by {excess.max().item():.3g}"
        return int(decided.sum())


def quantizing_projection_inputs(block: int, only: set[str] | None = None):
    """For tests/gguf_models.model_logits' `prepare`: every decoder-layer projection of a pdserve model
    (dense weights), or those named in `only`, rounds its input per `block` values, as the GGUF kernels do for
    one block type."""
    from pdserve.engine.model.layers import Linear

    def prepare(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.startswith("layers.") and (only is None or name in only):
                module.register_forward_pre_hook(lambda m, args: (quantize(args[0], block),))
    return prepare
