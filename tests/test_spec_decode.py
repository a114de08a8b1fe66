"""Speculative decoding (n-gram drafts verified on the decode side): the same greedy tokens as plain
decoding in every mode, pools left free by aborts and preemption, and the rejection rule's output
distribution equal to plain sampling's."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.spec_policy import DraftGate, StepBudget
from pdserve.engine.core.speculative import SpeculativeConfig, propose_ngram
from pdserve.engine.engine import Engine
from pdserve.engine.llm import LLM
from pdserve.engine.worker.sampling.sampler import Sampler
from pdserve.engine.worker.sampling.sampling_table import SamplingTable
from pdserve.engine.worker.spec_verify import verify
from pdserve.engine.worker.step import VerifyInput
from tests.models import demo_checkpoint, engine_config
from tests.test_engine_modes import abort_after, assert_pools_free, prompts, run_engine, staggered, wait_idle

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def drafts_unpriced(monkeypatch):
    """Every decode step drafts each row's whole proposal: the gate prices drafts from measured step times
    (its rule is tested on seeded costs in test_spec_policy.py), so here which drafts are verified, and
    whether any is rejected, would depend on how loaded the machine is."""
    monkeypatch.setattr(DraftGate, "budget", lambda self, rows, prefill_tokens:
                        None if prefill_tokens > 0 or rows <= 0 else StepBudget())


def echo_prompts(lengths, seed=0):
    """Prompts that repeat themselves, so that lookups find drafts (and the model often follows them)."""
    return [p * 3 for p in prompts(lengths, seed=seed)]


def generate(mode: str, requests, speculative=None, **overrides) -> tuple[list[list[int]], Engine]:
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32, speculative=speculative,
                                  **overrides))
    outputs = asyncio.run(run_engine(engine, staggered(engine, requests)))
    assert_pools_free(engine)
    return outputs, engine


def speculator(engine: Engine):
    return engine.actors[-1].speculator


# configuration and drafts
def test_config_is_read_as_vllm_spells_it():
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, '
                                         '"prompt_lookup_min": 2, "prompt_lookup_max": 6}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (5, 2, 6)
    assert SpeculativeConfig.from_json({"method": "ngram", "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert SpeculativeConfig.from_json(None) is None
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"prompt_lookup_min": 4, '
                '"prompt_lookup_max": 2}', '{"model": "x"}', "[1]"):
        with pytest.raises(ValueError, match="speculative-config"):
            SpeculativeConfig.from_json(bad)


def test_ngram_proposes_what_followed_the_newest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 5]          # "2 3" last seen before 7 8 5
    assert propose_ngram(tokens, 1, 1, 3) == [7]
    assert propose_ngram(np.array([1, 2, 3, 4]), 3, 1, 3) == []  # 4 never occurred before
    assert propose_ngram(np.array([5, 6, 5, 6, 5]), 4, 2, 2) == [6, 5]
    assert propose_ngram(np.array([4, 1, 2, 4, 3, 2]), 2, 2, 3) == []   # n=1 would match, min is 2


# the same greedy tokens
@pytest.mark.parametrize("mode", ("colocated", "disaggregated", "adaptive"))
def test_greedy_tokens_identical_with_and_without_speculation(mode):
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40, 9, 33], seed=1))]
    plain, engine = generate(mode, requests)
    engine.close()
    spec, engine = generate(mode, requests, SPEC)
    counters = speculator(engine).counters
    engine.close()
    assert spec == plain
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0
    assert counters.num_accepted_tokens < counters.num_draft_tokens      # rejections happened too


def test_rows_with_a_mask_or_bias_do_not_draft():
    """Verification applies no grammar mask or logit_bias, so such rows decode one token a step."""
    biased = replace(GREEDY, logit_bias=((7, 3.0), (11, 2.0)))
    requests = [Request(f"r{i}", p, biased) for i, p in enumerate(echo_prompts([20, 40], seed=4))]
    plain, engine = generate("colocated", requests)
    engine.close()
    spec, engine = generate("colocated", requests, SPEC)
    counters = speculator(engine).counters
    engine.close()
    assert spec == plain and counters.num_drafts == 0


def test_process_workers_give_the_same_greedy_tokens():
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40], seed=2))]
    plain, engine = generate("disaggregated", requests)
    engine.close()
    spec, engine = generate("disaggregated", requests, SPEC, workers="process")
    engine.close()
    assert spec == plain


def test_penalties_min_tokens_and_stop_tokens_see_the_drafts_as_history():
    params = [SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.05,
                             ignore_eos=True),
              SamplingParams(max_tokens=37, temperature=0.0, presence_penalty=0.1, min_tokens=12)]
    batch = echo_prompts([25, 30], seed=3)
    requests = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(batch, params))]
    plain, engine = generate("colocated", requests)
    engine.close()
    stop_at = plain[1][15]                                  # a token that ends the stream in mid-draft
    requests += [Request("stop", batch[1], SamplingParams(max_tokens=37, temperature=0.0, stop_token_ids=[stop_at],
                                                          ignore_eos=True))]
    plain, engine = generate("colocated", requests)
    engine.close()
    spec, engine = generate("colocated", requests, SPEC)
    counters = speculator(engine).counters
    engine.close()
    assert spec == plain
    assert counters.num_accepted_tokens > 0
    assert plain[2][-1] == stop_at and len(plain[2]) <= 16
    assert [len(t) for t in spec[:2]] == [30, 37]


def test_seeded_sampled_rows_give_the_tokens_plain_sampling_gives():
    """A seeded row draws each position from its (seed, output number) stream and keeps drafts equal to the
    draws: the same tokens without speculation, in any mode, whatever drafts each step's cost allowed."""
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(echo_prompts([30, 12], seed=4))]
    plain, engine = generate("colocated", requests)
    engine.close()
    first, engine = generate("colocated", requests, SPEC)
    counters = speculator(engine).counters
    engine.close()
    second, engine = generate("disaggregated", requests, SPEC)
    engine.close()
    assert first == second == plain and all(len(t) == 30 for t in first)
    assert counters.num_drafts > 0


@pytest.mark.parametrize("mode", ("colocated", "disaggregated"))
def test_aborts_mid_verification_free_every_block(mode):
    engine = Engine(engine_config(demo_checkpoint(), mode=mode, max_prefill_tokens=32, speculative=SPEC))
    rng = random.Random(0)
    verifying, loop, aborted = [], [], []
    decode = engine.actors[-1]
    runner_execute = decode.runner.execute

    def execute(step):                                      # abort some verifying rows while their step runs
        if step.verify:
            verifying.append(step)
            rows = {v.row for v in step.verify}
            for seq in (decode.scheduler if mode == "disaggregated" else decode.decode).running:
                if seq.row in rows and (len(aborted) < 3 or rng.random() < 0.3):
                    aborted.append(seq.request_id)
                    loop[0].call_soon_threadsafe(engine.abort, seq.request_id)
        return runner_execute(step)

    decode.runner.execute = execute

    async def scenario():
        loop.append(asyncio.get_running_loop())
        streams = [engine.submit(Request(f"a{i}", p, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                    temperature=0.0)))
                   for i, p in enumerate(echo_prompts([rng.randint(4, 60) for _ in range(12)], seed=5))]
        results = await asyncio.gather(*(abort_after(engine, s, rng.randint(0, 20)) for s in streams))
        await wait_idle(engine)
        return results

    results = asyncio.run(run_engine(engine, scenario()))
    assert verifying and aborted
    assert_pools_free(engine)
    assert any(reason is FinishReason.ABORT for _, reason in results)
    assert all(len(tokens) == 40 for tokens, reason in results if reason is FinishReason.LENGTH)
    engine.close()


@pytest.mark.parametrize("mode", ("colocated", "disaggregated"))
def test_preemption_with_drafts_keeps_tokens_and_frees_every_block(mode):
    requests = [Request(f"p{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(echo_prompts([14] * 8, seed=6))]
    expected, engine = generate(mode, requests, max_model_len=256)
    engine.close()
    got, tight = generate(mode, requests, SPEC, max_model_len=256, kv_cache_memory="1MiB")
    decode = tight.actors[-1]
    assert (decode.scheduler if mode == "disaggregated" else decode.decode).num_preemptions > 0
    assert speculator(tight).counters.num_accepted_tokens > 0
    tight.close()
    assert got == expected


# the rejection rule on synthetic logits
def verify_draws(logits: torch.Tensor, drafts: list[int], params: SamplingParams, draws: int) -> list[tuple]:
    """`draws` rows, each verifying `drafts` against `logits` [K + 1, V], each seeded differently."""
    vocab = logits.shape[1]
    table = SamplingTable(vocab, frozenset(), torch.device("cpu"))
    rows = []
    for row in range(draws):
        table.add(row, replace(params, seed=row), [1, 2], [])
        rows.append(VerifyInput(row, 5, (3, *drafts)))
    return list(verify(Sampler(vocab, frozenset()), table, logits.repeat(draws, 1), rows))


def plain_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    table = SamplingTable(logits.shape[1], frozenset(), torch.device("cpu"))
    table.add(0, params, [1, 2], [])
    sampler = Sampler(logits.shape[1], frozenset())
    batch = table.batch(np.array([0]))
    return sampler.probabilities(sampler.processed(logits[:1], batch), batch)[0].double().numpy()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
def test_rejection_rule_keeps_plain_sampling_distribution(params):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=generator) * 1.5              # [K + 1, V], K = 2 drafts
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]    # a likely, not the likeliest, first draft
    draws = 20000
    outputs = verify_draws(logits, drafts, params, draws)
    first = np.bincount([o[0] for o in outputs], minlength=8)
    expected = plain_probs(logits[0:1], params)
    assert_same_distribution(first, expected)
    second = np.bincount([o[1] for o in outputs if o[0] == drafts[0]], minlength=8)
    assert_same_distribution(second, plain_probs(logits[1:2], params))  # given the first draft kept
    kept = [len(o) - 1 for o in outputs]
    assert 0 < np.mean([k >= 1 for k in kept]) < 1 and max(kept) == 2


def assert_same_distribution(counts: np.ndarray, probs: np.ndarray) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support was drawn"
    observed, expected = counts[support], probs[support] / probs[support].sum() * counts.sum()
    assert chisquare(observed, expected).pvalue > 1e-3


def test_a_wrong_rule_is_caught():
    """Resampling from p itself (not p without the draft) after a rejection skews the first token."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, generator=generator) * 1.5
    p = plain_probs(logits[0:1], SamplingParams(temperature=1.0))
    p = p / p.sum()
    draft = int(np.argsort(p)[-2])
    rng = np.random.default_rng(0)
    wrong = [draft if rng.random() < p[draft] else rng.choice(8, p=p) for _ in range(20000)]
    with pytest.raises(AssertionError):
        assert_same_distribution(np.bincount(wrong, minlength=8), p)


def test_greedy_rows_keep_drafts_up_to_the_first_argmax_mismatch():
    logits = torch.full((4, 6), -5.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 0] = 5.0      # argmax per position: 2 4 1 0
    table = SamplingTable(6, frozenset(), torch.device("cpu"))
    table.add(0, SamplingParams(temperature=0.0), [1], [])
    out = verify(Sampler(6, frozenset()), table, logits, [VerifyInput(0, 3, (5, 2, 4, 3))])
    assert out == ((2, 4, 1),)                                          # 2, 4 kept; 3 rejected, argmax 1 taken


def test_penalised_rows_count_earlier_drafts_and_min_tokens_counts_positions():
    logits = torch.full((3, 6), -5.0)
    logits[0, 2] = logits[1, 2] = 5.0
    logits[1, 4] = 4.5                                                  # wins once 2 is penalised for one use
    logits[2, 1] = 5.0
    table = SamplingTable(6, frozenset({1}), torch.device("cpu"))
    table.add(0, SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], [])
    eos_first = torch.full((3, 6), -5.0)
    eos_first[:, 1] = 5.0                                               # EOS is the argmax everywhere
    eos_first[0, 3] = eos_first[1, 4] = eos_first[2, 5] = 4.0
    table.add(1, SamplingParams(temperature=0.0, min_tokens=2), [0], [])
    sampler = Sampler(6, frozenset({1}))
    out = verify(sampler, table, torch.cat([logits, eos_first]),
                 [VerifyInput(0, 3, (5, 2, 2)), VerifyInput(1, 3, (5, 3, 4))])
    assert out == ((2, 4), (3, 4, 1))                                   # EOS masked for outputs 0 and 1 only


@pytest.mark.parametrize("mode", ("adaptive", "disaggregated", "colocated"))
def test_default_model_gives_the_same_greedy_text_and_accepts_drafts(smollm2, mode):
    """SmolLM2 asked to repeat a passage: speculation keeps most drafts and changes no token. Its weights are loaded
    dequantized: from the GGUF blocks a verify step's rows and a decode step's take different kernel paths (which
    row counts read the blocks is a start-up race), and the passage has a near tie that then flips."""
    passage = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    prompts_ = [[{"role": "user", "content": f"Repeat this code exactly:\n{passage}"}],
                [{"role": "user", "content": "What is the capital of France?"}]]
    outputs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 2}):
        llm = LLM(config=engine_config(smollm2[1], mode=mode, quantization="none"), speculative_config=spec)
        try:
            tokenizer = llm.tokenizer
            batch = [tokenizer.encode_chat(c) for c in prompts_]
            outputs[spec is None] = [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=40,
                                                                                         temperature=0.0))]
            counters = llm.engine.actors[-1].speculator and llm.engine.actors[-1].speculator.counters
        finally:
            llm.close()
    assert outputs[False] == outputs[True]
    assert counters.num_accepted_tokens >= counters.num_draft_tokens / 3


def test_stop_strings_cut_a_multi_token_step_where_plain_decoding_stops():
    prompt = echo_prompts([20, 40, 9], seed=1)[2]                      # the model loops on this one
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outputs = {}
    for name, speculative in (("plain", None), ("spec", spec)):
        llm = LLM(config=engine_config(demo_checkpoint(), mode="disaggregated"), speculative_config=speculative)
        try:
            free = llm.generate([list(prompt)], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
            stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
            cut = llm.generate([list(prompt)], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                             stop=[stop]))[0]
            accepted = llm.engine.actors[-1].speculator and llm.engine.actors[-1].speculator.counters
        finally:
            llm.close()
        outputs[name] = (free.text, stop, cut.text, cut.finish_reason)
    assert outputs["spec"] == outputs["plain"]
    assert outputs["plain"][3] == "stop" and len(outputs["plain"][2]) < len(outputs["plain"][0])
    assert accepted.num_accepted_tokens > 0


def test_verification_logits_match_transformers_in_decode_and_mixed_steps():
    """A verifying row's logits, as decode rows (a step without chunks) or as a chunk (beside a prefill chunk),
    equal transformers' over the prompt and the drafts."""
    import transformers

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.worker.model_runner import ModelRunner, load_model
    from pdserve.engine.worker.step import ChunkInput, NewRow, StepInput

    path = demo_checkpoint()
    model = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 256)
    runner = ModelRunner(model, 16, 16, frozenset())
    a, b = prompts([23, 11], seed=9)
    drafts = tuple(prompts([4], seed=10)[0])
    greedy = SamplingParams(temperature=0.0)
    runner.apply(StepInput(new_rows=(NewRow(0, a, len(a), (0, 1), greedy), NewRow(1, b, len(b), (2,), greedy))))
    with torch.inference_mode():
        runner.logits(StepInput(chunks=(ChunkInput(0, 0, len(a) - 1, False), ChunkInput(1, 0, len(b) - 1, False))))
        verify = (VerifyInput(0, len(a) - 1, (a[-1], *drafts)),)
        as_decode = runner.logits(StepInput(verify=verify))
        mixed = runner.logits(StepInput(chunks=(ChunkInput(1, len(b) - 1, 1, True),), verify=verify))[1:]
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        expected = reference(torch.tensor([a + drafts])).logits[0, len(a) - 1:]
    vocab = expected.shape[-1]
    torch.testing.assert_close(as_decode[:, :vocab], expected, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[:, :vocab], expected, atol=2e-4, rtol=1e-4)


def test_logprobs_of_drafted_tokens_are_those_plain_decoding_reports():
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3)
    requests = [Request("r", echo_prompts([20, 40, 9], seed=1)[2], params)]       # the model loops on it
    results = {}
    for name, speculative in (("plain", None), ("spec", SPEC)):
        engine = Engine(engine_config(demo_checkpoint(), mode="colocated", speculative=speculative))

        async def run():
            return [[e.logprobs for e in [event async for event in engine.submit(r)]] for r in requests]

        results[name] = asyncio.run(run_engine(engine, run()))
        counters = engine.actors[-1].speculator and engine.actors[-1].speculator.counters
        engine.close()
    plain = [lp for event in results["plain"][0] for lp in event]
    spec = [lp for event in results["spec"][0] for lp in event]
    assert [lp.token_id for lp in spec] == [lp.token_id for lp in plain] and len(plain) == 30
    for a, b in zip(spec, plain):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
    assert counters.num_accepted_tokens > 0
