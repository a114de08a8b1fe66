"""Prompt logprobs through the official openai client against transformers on the same checkpoint: lm-eval's
loglikelihood payload (echo, logprobs 1, max_tokens 1) in every mode with prompts longer than one prefill chunk,
both adaptive placements and the hand-off, and with worker processes; vLLM's `prompt_logprobs` on both endpoints, streamed and whole;
max_tokens 0 with echo; a prompt whose prefix is cached."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine import Engine
from tests.models import SLOS_SET, engine_config, hf_checkpoint
from tests.test_adaptive import SLOS, seed_costs
from tests.test_engine_modes import prompts
from tests.test_prompt_logprobs_engine import ARCH, assert_prompt_logprobs_match, reference
from tests.test_server_api import client, serve, wait_until_idle  # noqa: F401  (fixture)
from tests.tolerance import assert_float32_close, reference_logprobs

CHUNK = 16                                      # --max-prefill-tokens: every prompt here takes several chunks
LENGTHS = (40, 150)                             # with the seeded costs, adaptive keeps the first and sends the second


def build(mode: str, **overrides) -> Engine:
    """`mode`, or `mode/process`: with worker processes."""
    mode, _, workers = mode.partition("/")
    if workers:
        overrides["workers"] = workers
    if mode == "adaptive":
        return seed_costs(Engine(engine_config(hf_checkpoint(ARCH), mode=mode, max_prefill_tokens=CHUNK,
                                               **SLOS, **overrides)))
    return Engine(engine_config(hf_checkpoint(ARCH), mode=mode, max_prefill_tokens=CHUNK, **SLOS_SET, **overrides))


@pytest.fixture(scope="module")
def engines():
    built: dict[str, Engine] = {}

    def get(mode: str) -> Engine:
        if mode not in built:
            built[mode] = build(mode)
        return built[mode]

    yield get
    for engine in built.values():
        engine.close()


def is_greedy(token_logprobs, top_logprobs) -> bool:
    """lm-eval's local-completions check: each scored token is the likeliest at its position."""
    return all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "adaptive", "disaggregated/process"])
async def test_lm_eval_loglikelihood_payload_matches_transformers(engines, serve, mode):
    engine = engines(mode)
    base = await serve(engine)
    batch = [list(p) for p in prompts(LENGTHS, seed=7)]
    async with client(base) as c:
        out = await c.completions.create(model=hf_checkpoint(ARCH).name, prompt=batch, max_tokens=1, logprobs=1,
                                         echo=True, temperature=0, seed=1234)
    for prompt, choice in zip(batch, sorted(out.choices, key=lambda ch: ch.index)):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
            len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert_prompt_logprobs_match(prompt, lp.token_logprobs[1:len(prompt)])
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])       # the best one, and the token itself
        greedy = [max(top.values()) == lp_ for lp_, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:])]
        assert is_greedy(lp.token_logprobs[1:], lp.top_logprobs[1:]) == all(greedy) and not all(greedy)
        echo = engine.tokenizer.decode(prompt)
        assert choice.text.startswith(echo) and lp.text_offset[-1] == len(echo)        # the output token's
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        with torch.no_grad():
            greedy_token = reference()(torch.tensor([prompt])).logits[0, -1].argmax().item()
        ours32, ours64, scale = reference_logprobs(reference(), prompt, [greedy_token])
        assert_float32_close(torch.tensor(lp.token_logprobs[-1:]), ours32, ours64, scale)
    assert out.usage.completion_tokens == 2 and out.usage.prompt_tokens == sum(LENGTHS)
    if mode == "adaptive":
        decode = engine.actors[1]
        assert decode.local_prefills >= 1 and decode.remote_prefills >= 1
    await wait_until_idle(base)


async def test_prompt_logprobs_on_chat_and_completions_in_vllms_shape(engines, serve):
    engine = engines("disaggregated")
    base = await serve(engine)
    messages = [{"role": "user", "content": "Prompt logprobs " * 12}]
    chat_ids = list(engine.tokenizer.encode_chat(messages))
    prompt = list(prompts([50], seed=3)[0])
    async with client(base) as c:
        chat = await c.chat.completions.create(model=hf_checkpoint(ARCH).name, messages=messages, max_tokens=2,
                                               n=2, extra_body={"prompt_logprobs": 3})
        whole = await c.completions.create(model=hf_checkpoint(ARCH).name, prompt=prompt, max_tokens=2,
                                           extra_body={"prompt_logprobs": 0})
        stream = await c.completions.create(model=hf_checkpoint(ARCH).name, prompt=prompt, max_tokens=3,
                                            stream=True, extra_body={"prompt_logprobs": 0})
        chunks = [chunk async for chunk in stream]
        chat_stream = await c.chat.completions.create(model=hf_checkpoint(ARCH).name, messages=messages,
                                                      max_tokens=2, stream=True, extra_body={"prompt_logprobs": 3})
        chat_chunks = [chunk async for chunk in chat_stream]
    entries = chat.model_extra["prompt_logprobs"]
    assert [ch.model_extra.get("prompt_logprobs") for ch in chat_chunks if "prompt_logprobs" in ch.model_extra] \
        == [entries]
    assert len(entries) == len(chat_ids) and entries[0] is None
    assert_prompt_logprobs_match(chat_ids, [entry[str(t)]["logprob"] for t, entry in zip(chat_ids[1:], entries[1:])])
    for token, entry in zip(chat_ids[1:], entries[1:]):
        ranked = sorted((v for k, v in entry.items() if k != str(token) or v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:3] == [1, 2, 3] and len(entry) in (3, 4)
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
        own = entry[str(token)]
        assert own["decoded_token"] == engine.tokenizer.decode([token], skip_special_tokens=False)
        assert (own["rank"] <= 3) == (len(entry) == 3) and own["rank"] >= 1
    for scored in (whole.choices[0].model_extra["prompt_logprobs"],
                   next(ch.choices[0].model_extra["prompt_logprobs"] for ch in chunks
                        if "prompt_logprobs" in ch.choices[0].model_extra)):
        assert scored[0] is None and all(len(entry) == 1 for entry in scored[1:])
        assert_prompt_logprobs_match(prompt, [e[str(t)]["logprob"] for t, e in zip(prompt[1:], scored[1:])])
    assert sum("prompt_logprobs" in ch.choices[0].model_extra for ch in chunks if ch.choices) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_only(engines, serve, stream):
    engine = engines("colocated")
    base = await serve(engine)
    prompt = list(prompts([30], seed=5)[0])
    text = engine.tokenizer.decode(prompt)
    async with client(base) as c:
        out = await c.completions.create(model=hf_checkpoint(ARCH).name, prompt=prompt, max_tokens=0, logprobs=2,
                                         echo=True, stream=stream, **({"stream_options": {"include_usage": True}}
                                                                      if stream else {}))
        chunks = [chunk async for chunk in out] if stream else [out]
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(ch.text for ch in choices) == text
    assert choices[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 0
    lp = next(ch.logprobs for ch in choices if ch.logprobs is not None)
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None
    assert_prompt_logprobs_match(prompt, lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])


async def test_a_cached_prefix_is_computed_again_for_its_prompt_logprobs(serve):
    engine = build("colocated", enable_prefix_caching=True)
    base = await serve(engine)
    prompt = list(prompts([70], seed=9)[0])
    name = hf_checkpoint(ARCH).name
    try:
        async with client(base) as c:
            plain = await c.completions.create(model=name, prompt=prompt, max_tokens=1)
            again = await c.completions.create(model=name, prompt=prompt, max_tokens=1)
            scored = [await c.completions.create(model=name, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
                      for _ in range(2)]
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0            # the prefix is in the cache
        first, second = (s.choices[0].logprobs.token_logprobs[1:len(prompt)] for s in scored)
        assert first == second
        assert_prompt_logprobs_match(prompt, second)
        assert all(s.usage.prompt_tokens_details.cached_tokens == 0 for s in scored)
        await wait_until_idle(base)
    finally:
        await serve.close_all()
        engine.close()
