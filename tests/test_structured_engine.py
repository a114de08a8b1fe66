"""Constrained decoding in the engine on the default model: grammar masks and logit_bias on every unit
that samples, across the hand-off, preemption and a process boundary, checked with llguidance's own
matcher, jsonschema and the unconstrained engine."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.text.grammar import grammar_tokenizer, json_schema_grammar, regex_grammar
from tests.models import engine_config

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llms(smollm2):
    built: dict[tuple, LLM] = {}

    def get(mode: str, **overrides) -> LLM:
        key = (mode, *sorted(overrides.items()))
        if key not in built:
            # NOTE: dequantized weights: the GGUF's blocks and their dequantized tiles round differently, and
            # which one a step takes depends on its row count, so the modes' tokens part at a near tie
            built[key] = LLM(config=engine_config(smollm2[1], mode=mode, max_model_len=512, quantization="none",
                                                  **overrides))
        return built[key]

    yield get
    for llm in built.values():
        llm.close()


def allowed(llm: LLM, grammar: str, outputs: list[int]) -> np.ndarray:
    """llguidance's own verdict: [vocab] bool, the tokens allowed after `outputs`."""
    config = llm.engine.model_config
    tokenizer = grammar_tokenizer(llm.engine.model_dir, config.vocab_size, tuple(sorted(llm.engine.eos_token_ids)))
    matcher = LLMatcher(tokenizer, grammar)
    assert matcher.consume_tokens(outputs), matcher.get_error()
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    return np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)[:config.vocab_size]


def test_greedy_with_a_grammar_is_unconstrained_greedy_wherever_that_token_is_allowed(llms):
    llm, grammar = llms("colocated"), json_schema_grammar(PERSON)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=60, temperature=0.0, grammar=grammar))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    prompt, tokens = list(out.prompt_token_ids), list(out.token_ids)
    free = [o.token_ids[0] for o in llm.generate([prompt + tokens[:i] for i in range(len(tokens))],
                                                 SamplingParams(max_tokens=1, temperature=0.0))]
    followed = 0
    for i, (token, unconstrained) in enumerate(zip(tokens, free)):
        mask = allowed(llm, grammar, tokens[:i])
        assert mask[token], f"position {i}: token {token} is outside the grammar"
        if mask[unconstrained]:
            assert token == unconstrained, f"position {i}: {token} instead of the allowed greedy {unconstrained}"
            followed += 1
    assert followed > 0 and tokens[-1] in llm.engine.eos_token_ids


def requests() -> tuple[list[str], list[SamplingParams]]:
    person, digits = json_schema_grammar(PERSON), regex_grammar(r"[0-9]{3}-[a-z]{2,4}")
    params = [SamplingParams(max_tokens=60, temperature=0.0, grammar=person),
              SamplingParams(max_tokens=60, temperature=1.0, top_p=0.9, seed=7, frequency_penalty=0.5,
                             logprobs=2, grammar=person),
              SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=3, grammar=digits),
              SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((28, 100.0),))]
    return [PROMPT] * len(params), params


def check(outputs) -> None:
    for out in outputs[:2]:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
    assert outputs[1].logprobs and all(len(lp.top) == 2 for lp in outputs[1].logprobs)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outputs[2].text) and outputs[2].finish_reason == "stop"
    assert outputs[3].token_ids == (28,) * 8


@pytest.mark.parametrize("mode, overrides", [("disaggregated", {}), ("disaggregated", {"workers": "process"}),
                                             ("adaptive", {}), ("disaggregated", {"async_scheduling": True})])
def test_every_mode_samples_the_first_token_and_the_rest_under_the_same_constraints(llms, mode, overrides):
    prompts, params = requests()
    expected = llms("colocated").generate(prompts, params)
    check(expected)
    got = llms(mode, **overrides).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_logit_bias_minus_100_moves_greedy_off_its_first_choice(llms):
    llm = llms("colocated")
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    biased = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((first, -100.0),)))
    assert biased[0].token_ids[0] != first


NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 20,
           "maxItems": 20}


@pytest.mark.parametrize("mode, pool", [("disaggregated", "24MiB"), ("colocated", "12MiB")])
def test_preempted_and_prefilled_again_mid_grammar_gives_the_roomy_outputs(llms, smollm2, mode, pool):
    grammar = json_schema_grammar(NUMBERS)
    params = [SamplingParams(max_tokens=80, temperature=0.0 if i % 2 else 0.8, seed=i, grammar=grammar)
              for i in range(6)]
    prompts = [PROMPT.replace("a person", f"{i + 20} numbers") for i in range(6)]
    expected = llms(mode).generate(prompts, params)
    tight = LLM(config=engine_config(smollm2[1], mode=mode, max_model_len=512, kv_cache_memory=pool,
                                     quantization="none"))
    try:
        got = tight.generate(prompts, params)
        decode = tight.engine.actors[-1]
        assert (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions > 0
        for actor in tight.engine.actors:
            assert actor.blocks.num_used == 0, actor.name
    finally:
        tight.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for out in got:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), NUMBERS)
