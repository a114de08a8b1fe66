"""GGUF files llama.cpp's own converter wrote (tests/fixtures/gguf, made by make_fixtures.py) from tiny
transformers checkpoints of each family, against transformers on those checkpoints: the same weights,
logits, greedy tokens (prompts longer than the sliding windows and than a prefill chunk), tokenizer
(SentencePiece and byte-level BPE) and chat template. Where llama.cpp's source tree is found
($LLAMA_CPP_DIR, or make_fixtures.LLAMA_CPP_DEFAULT), the fixtures are converted again and must come out
byte for byte the same."""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from safetensors.torch import load_file

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model import gguf_modules, quant_gguf
from pdserve.engine.model.gguf import converted_dir
from pdserve.engine.model.quant_probe import ProbeResult
from pdserve.engine.model.weights import checkpoint_files
from pdserve.engine.text.tokenizer import Tokenizer
from tests.fixtures.gguf import make_fixtures
from tests.gguf_models import float_tensors, model_logits, rewritten
from tests.hf_models import reference_model, transformers_greedy
from tests.models import engine_config
from tests.quant_reference import quantizing_projection_inputs
from tests.test_quant_model import counted
from tests.tolerance import SLACK, assert_float32_close, reference_logits

FIXTURES = Path(make_fixtures.__file__).parent
Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q8_0_BLOCK = gguf.GGML_QUANT_SIZES[Q8_0][0]
NAMES = make_fixtures.FIXTURES
TEXTS = ["Hello world 12345  foo\n\n  bar", "def f(x):\n    return x ** 2", "Größe ≈ 4.0 🚀 你好，世界！",
         "   \t  trailing   ", " leading space", "a\r\nb 1 22 333 4444",
         "<start_of_turn>user\nhi<end_of_turn>\n<|user|>\nhi<|end|>\n<|assistant|>x<|im_start|>y<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]


def gguf_file(name: str) -> Path:
    return FIXTURES / name / f"{name}.gguf"


@functools.cache
def reference(name: str):
    return reference_model(FIXTURES / name)


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PDSERVE_CACHE", str(tmp_path_factory.mktemp("gguf-families-cache")))
    yield
    patch.undo()


def prompts(vocab: int, seed: int, lengths=(5, 40, 100)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("name", NAMES)
def test_conversion_holds_exactly_the_checkpoints_weights(name):
    """Every tensor transformers loads (not Qwen3.5's MTP block), bit for bit; A_log, which the file holds as
    -exp(A_log) in float32, once rounded to the checkpoint's dtype."""
    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        return {k: v for path in set(checkpoint_files(directory).values()) for k, v in load_file(path).items()
                if not k.startswith("mtp.")}

    ours, theirs = tensors(converted_dir(gguf_file(name))), tensors(FIXTURES / name)
    assert ours.keys() == theirs.keys()
    for k in ours:
        mine = ours[k].to(theirs[k].dtype) if k.endswith("A_log") else ours[k]
        assert torch.equal(mine.float(), theirs[k].float()), (name, k)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    model = reference(name)
    batch = prompts(model.config.vocab_size, seed=0)
    for prompt, ours in zip(batch, model_logits(converted_dir(gguf_file(name)), batch)):
        expected32, expected64 = reference_logits(model, prompt)
        assert expected64.std() > 0.1
        assert_float32_close(ours, expected32, expected64)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers(name):
    model = reference(name)
    batch = prompts(model.config.vocab_size, seed=1)
    llm = LLM(config=engine_config(gguf_file(name), max_prefill_tokens=16))
    try:
        outputs = llm.generate(batch, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    for prompt, output in zip(batch, outputs):
        assert list(output.token_ids) == transformers_greedy(model, prompt, 16)


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_and_chat_template_match_the_checkpoints(name):
    theirs = transformers.AutoTokenizer.from_pretrained(FIXTURES / name)
    ours = Tokenizer.from_dir(converted_dir(gguf_file(name)))
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == rendered


def requantized(src: Path, dst: Path) -> Path:
    """`src` with every projection stored in Q8_0 blocks, its metadata and other tensors as they are (float32),
    as llama-quantize writes them: projections with rows of whole blocks only (not a Gated DeltaNet's
    convolution), outer dimensions of 1 dropped (a shared expert's gate: (hidden,))."""
    tensors = []
    for name, values, _ in float_tensors(src):
        while values.ndim > 1 and values.shape[0] == 1:
            values = values[0]
        if name.startswith("blk.") and values.ndim == 2 and values.shape[1] % Q8_0_BLOCK == 0:
            tensors.append((name, gguf.quants.quantize(values, Q8_0), Q8_0))
        else:
            tensors.append((name, values, None))
    return rewritten(src, dst, tensors)


@pytest.mark.parametrize("name", ["phi3", "smollm3", "gemma3", "gemma4", "gemma4moe", "qwen2moe", "mixtral",
                                  "qwen3next", "qwen35", "qwen35moe"])
def test_quantized_blocks_of_every_layout_compute_as_their_dequantized_weights(name, tmp_path, monkeypatch):
    """Phi-3's fused and partially rotated qkv, SmolLM3's permuted q/k, Gemma's norms, Gemma 4's projections of two
    head sizes, its per-layer inputs and its experts beside a dense MLP, Qwen2-MoE's shared expert,
    Mixtral's permuted q/k beside dense experts, and the hybrids' gated queries beside Gated DeltaNet layers
    (whose projections load dequantized, their conv and decay float): the GGUF's own Q8_0
    blocks (--quantization gguf, which rounds each projection's input per 32 values as llama.cpp does)
    give the dense model's logits, within SLACK times how far that rounding (of the projections held in blocks)
    moves the dense model's own (tests/quant_reference.py)."""
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(256, ()))
    path = requantized(gguf_file(name), tmp_path / f"{name}.Q8_0.gguf")
    model_dir, batch = converted_dir(path), prompts(384, seed=2)          # one step of 145 rows: the blocks
    calls, held = counted(monkeypatch, gguf_modules, "gguf_linear_native"), set()
    ours = model_logits(model_dir, batch, "gguf", prepare=lambda model: held.update(
        n for n, m in model.named_modules() if isinstance(m, gguf_modules.GGUFLinear)))
    assert calls, "the GGUF kernel never ran"
    exact = model_logits(model_dir, batch, "none")
    moved = model_logits(model_dir, batch, "none", prepare=quantizing_projection_inputs(32, held))
    for o, e, m in zip(ours, exact, moved):
        bound = SLACK * (m - e).abs().amax(dim=-1) + 2 ** -20 * e.abs().amax()
        assert ((o - e).abs().amax(dim=-1) <= bound).all()


def test_fixtures_are_what_llama_cpp_writes(tmp_path):
    llama_cpp = make_fixtures.llama_cpp_dir()
    if llama_cpp is None:
        pytest.skip("llama.cpp's source tree not found (set LLAMA_CPP_DIR): the committed fixtures are tested above")
    for name in NAMES:
        make_fixtures.convert(FIXTURES / name, tmp_path / f"{name}.gguf", llama_cpp)
        assert (tmp_path / f"{name}.gguf").read_bytes() == gguf_file(name).read_bytes(), name
