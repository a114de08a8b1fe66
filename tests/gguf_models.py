"""Small GGUF files written the way llama.cpp's converter writes them, from weights transformers made.

`write_gguf` takes a transformers model, permutes Llama's Q/K rows as llama.cpp does, quantizes each
tensor with `gguf.quants.quantize` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16, F32), and adds the
demo byte-level BPE tokenizer as GGUF metadata. gguf-py has no quantizer for the K-quants, so a
Q4_K or Q6_K tensor is random but well-formed blocks (`k_quant_blocks`): both loaders under test
then read the same bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from pdserve.engine.model.demo_corpus import CHAT_TEMPLATE, ENDOFTEXT, IM_END, SPECIAL_TOKENS, tokenizer_json
from pdserve.engine.model.gguf_weights import dequantized, logical_shape

Q = gguf.GGMLQuantizationType
VOCAB = 1024
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def make_transformers_model(arch: str, tied: bool, seed: int = 0, rope_scaling: dict | None = None):
    """A random transformers Llama or Qwen2 with rows long enough for K-quants (256)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, initializer_range=0.05, tie_word_embeddings=tied,
                  bos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT), eos_token_id=SPECIAL_TOKENS.index(IM_END))
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=rope_scaling)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common, rope_theta=1e6)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` of Q/K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_blocks(rows: int, cols: int, kind: Q, seed: int) -> np.ndarray:
    """Random, well-formed blocks of a type gguf-py cannot quantize (the K types, IQ4_NL, IQ4_XS) for a
    [rows, cols] tensor: random bytes, each block's f16 scales set to values of order 0.05 / (its
    integer scale x quant), so that the weights are of order 0.05."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset, value in SCALE_FIELDS[kind]:
        scales = rng.uniform(0.5, 1.5, (len(blocks), 1)) * value
        blocks[:, offset:offset + 2] = scales.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


SCALE_FIELDS = {Q.Q4_K: ((0, 2e-4), (2, 1.5e-3)), Q.Q5_K: ((0, 1e-4), (2, 1.5e-3)), Q.Q6_K: ((208, 2e-5),),
                Q.IQ4_XS: ((0, 2e-5),), Q.IQ4_NL: ((0, 5e-4),)}          # (byte offset of an f16, its value)


def random_blocks(kind: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """A random [rows, cols] weight in `kind`'s blocks: quantized by gguf-py where it can, else
    `k_quant_blocks`."""
    if kind in SCALE_FIELDS:
        return k_quant_blocks(rows, cols, kind, seed)
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((rows, cols)) * 0.05 + rng.uniform(-0.02, 0.02, (rows, 1))
    return gguf.quants.quantize(weight.astype(np.float32), kind)


def write_gguf(model, path: Path, types: dict[str, Q], pre: str = "qwen2", add_bos: bool = False,
               rope_freqs: np.ndarray | None = None, metadata: dict | None = None, arch: str | None = None) -> Path:
    """`model` as a GGUF file; `types` maps a substring of the GGUF tensor name to its type (default F32).

    `metadata` replaces keys: {key: (value, GGUFValueType)}, or {key: None} to leave one out.
    """
    c = model.config
    writer = gguf.GGUFWriter(path, arch or c.model_type)
    writer.add_name("pdserve test model")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if c.model_type == "llama":
        writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    add_tokenizer(writer, pre, add_bos)
    for key, value in (metadata or {}).items():
        if value is None:
            writer.kv_data[0].pop(key)
        else:
            writer.add_key_value(key, *value)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        add_tensor(writer, gguf_name(hf_name), _gguf_layout(hf_name, tensor.numpy(), c), types)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, types: dict[str, Q]) -> None:
    kind = next((t for key, t in types.items() if key in name), Q.F32) if values.ndim == 2 else Q.F32
    if kind in SCALE_FIELDS:
        data = k_quant_blocks(*values.shape, kind, seed=len(name) * 7919 + sum(map(ord, name)))
    elif kind in QUANTIZABLE:
        data = gguf.quants.quantize(values.astype(np.float32), kind)
    else:                                               # a type nothing can read: zero blocks
        block, size = gguf.GGML_QUANT_SIZES[kind]
        data = np.zeros((values.shape[0], values.shape[1] // block * size), np.uint8)
    writer.add_tensor(name, data, raw_dtype=kind)


def rewritten(src: Path, dst: Path, tensors, metadata: dict | None = None) -> Path:
    """A GGUF file at `dst` with `src`'s metadata (`metadata`'s keys replaced: key -> (value, GGUFValueType), or
    None to leave the key out) and `tensors`: (name, values or raw blocks, their type or None for the values')."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    metadata = metadata or {}
    for field in reader.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF.") and field.name not in metadata:
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for key, value in metadata.items():
        if value is not None:
            writer.add_key_value(key, *value)
    for name, values, kind in tensors:
        writer.add_tensor(name, values, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def float_tensors(path: Path):
    """(name, float32 values in row-major shape, None) for every tensor of the GGUF file at `path`, for `rewritten`."""
    return [(t.name, dequantized(t).float().reshape(logical_shape(t)).numpy(), None)
            for t in gguf.GGUFReader(path).tensors]


def corrupt_tensor(path: Path, name: str) -> None:
    """Overwrite the first block's fp16 scale of tensor `name` (Q8_0, Q4_0 or Q4_1) with NaN, in place."""
    offset = next(t.data_offset for t in gguf.GGUFReader(path).tensors if t.name == name)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([np.nan], np.float16).tobytes())


def add_tokenizer(writer: gguf.GGUFWriter, pre: str, add_bos: bool) -> None:
    """The demo tokenizer as llama.cpp stores a byte-level BPE: tokens, CONTROL types, merges."""
    spec = json.loads(tokenizer_json(VOCAB))
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index(ENDOFTEXT))
    writer.add_eos_token_id(SPECIAL_TOKENS.index(IM_END))
    writer.add_pad_token_id(SPECIAL_TOKENS.index(ENDOFTEXT))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def _gguf_layout(hf_name: str, w: np.ndarray, c) -> np.ndarray:
    if c.model_type == "llama" and "q_proj" in hf_name:
        return permute(w, c.num_attention_heads)
    if c.model_type == "llama" and "k_proj" in hf_name:
        return permute(w, c.num_key_value_heads)
    return w


def model_logits(model_dir: Path, prompts: list[list[int]], quantization: str = "none",
                 prepare=None) -> list[torch.Tensor]:
    """Every position's float32 logits from pdserve's model, each prompt prefilled in one step; `prepare`
    (when given) is called with the loaded model first."""
    from pdserve.engine.actors.runner_rows import RunnerRows
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.core.batch import Batch, ScheduledChunk
    from pdserve.engine.core.block_manager import BlockManager
    from pdserve.engine.core.messages import Request
    from pdserve.engine.core.sequence import Sequence
    from pdserve.engine.worker.memory import kv_layout
    from pdserve.engine.worker.model_runner import ModelRunner, load_model
    from pdserve.engine.worker.state_pool import slot_blocks
    from pdserve.engine.worker.window_pool import slot_blocks as window_slot_blocks

    longest = max(map(len, prompts))
    blocks = -(-longest // 16) * len(prompts)
    model = load_model(ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"), longest, quantization)
    if prepare is not None:
        prepare(model)
    windows = len(prompts) if model.config.mixed_kv_shapes else 0      # Gemma 4: its sliding layers in window slots
    if windows:
        pool = blocks * (window_slot_blocks(model.config) + 1)           # a slot for each block
    else:
        state_blocks = len(prompts) * slot_blocks(model.config, kv_layout(model.config, 16), torch.float32)
        pool = max(blocks, state_blocks) + state_blocks                # NOTE: state slots take at most half a pool
    runner = ModelRunner(model, pool, 16, frozenset(), state_slots=len(prompts), window_seqs=windows)
    manager = BlockManager(runner.num_blocks, 16, state_slots=runner.state_slots, window_slots=runner.window_slots)
    seqs = [Sequence(Request(str(i), tuple(p))) for i, p in enumerate(prompts)]
    for seq in seqs:
        seq.block_table = manager.grow(seq.request_id, seq.num_tokens)
        seq.state_slot = manager.state_slot(seq.request_id)
    step = RunnerRows().step_input(Batch(chunks=tuple(ScheduledChunk(s, 0, s.num_tokens, False) for s in seqs)),
                                   manager.take_window_assignments())
    runner.apply(step)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(runner.prepare(step), runner.kv_pool))
    return list(logits.split([len(p) for p in prompts]))
