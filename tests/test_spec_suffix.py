"""The suffix method: drafts equal to a brute-force reading of suffix decoding's definition on random
token sequences, the cache of earlier outputs bounded, and greedy tokens unchanged in every mode."""
from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import SpeculativeConfig, Speculator
from pdserve.engine.core.suffix_proposer import SEPARATOR, SuffixCache, SuffixParams, propose_suffix
from tests.test_spec_decode import GREEDY, drafts_unpriced, echo_prompts, generate, speculator  # noqa: F401


# a brute-force reference: every count by scanning the texts
def count(texts: list[list[int]], s: list[int]) -> int:
    return sum(t[i:i + len(s)] == s for t in texts for i in range(len(t) - len(s) + 1))


def newest_end(texts: list[list[int]], s: list[int]) -> tuple[int, int]:
    """(text index, end) of the newest occurrence of `s` (later texts are newer)."""
    return max(((n, i) for n, t in enumerate(texts) for i in range(len(t) - len(s) + 1) if t[i:i + len(s)] == s),
               default=(-1, -1))


def reference_walk(texts, s, budget, min_prob) -> tuple[list[int], list[float]]:
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < budget:
        followers = {t[i + len(s)] for t in texts for i in range(len(t) - len(s)) if t[i:i + len(s)] == s}
        if not followers:
            break
        best = max(followers, key=lambda c: (count(texts, s + [c]), newest_end(texts, s + [c])))
        prob *= count(texts, s + [best]) / count(texts, s)
        if prob < min_prob:
            break
        tokens.append(best)
        probs.append(prob)
        s = s + [best]
    return tokens, probs


def reference_best(texts, pattern, k, p: SuffixParams) -> tuple[tuple[int, ...], float]:
    best: tuple[tuple[int, ...], float] = ((), 0.0)
    for m in range(1, min(len(pattern) - 1, p.max_depth - 1) + 1):
        budget = max(0, min(k, int(m * p.max_spec_factor + p.max_spec_offset + 1e-6), p.max_depth - m))
        tokens, probs = reference_walk(texts, pattern[-m:], budget, p.min_token_prob)
        if budget and sum(probs) >= best[1]:
            best = (tuple(tokens), sum(probs))
    return best


def reference(context: list[int], outputs: list[list[int]], k: int, p: SuffixParams) -> tuple[int, ...]:
    pattern = context[-p.max_depth:]
    own = reference_best([context], pattern, k, p)
    other = reference_best(outputs, pattern, k, p) if outputs else ((), 0.0)
    return other[0] if other[1] > own[1] else own[0]


def with_separator(tokens: list[int]) -> np.ndarray:
    return np.array([*tokens, SEPARATOR], dtype=np.int64)


def random_text(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Random tokens with copied stretches, so that long matches and repeated continuations occur."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.4:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randint(2, 12)]
        else:
            out.append(rng.randrange(vocab))
    return out[:length]


@pytest.mark.parametrize("seed", range(12))
def test_drafts_match_a_brute_force_reading_of_suffix_decoding(seed):
    rng = random.Random(seed)
    for _ in range(25):
        params = SuffixParams(rng.randint(2, 12), rng.choice((0.5, 1.0, 2.0, 4.0)), rng.choice((0.0, 0.1, 0.3, 0.6)))
        vocab = rng.randint(2, 6)
        context = random_text(rng, vocab, rng.randint(1, 80))
        outputs = [random_text(rng, vocab, rng.randint(1, 30)) for _ in range(rng.randint(0, 4))]
        cache = SuffixCache(max_requests=8)
        for output in outputs:
            cache.add(output)
        k = rng.randint(1, 10)
        got = propose_suffix(with_separator(context), len(context), cache, k, params)
        assert got.tokens == reference(context, outputs, k, params), (context, outputs, k, params)
        assert len(got.tokens) <= k and all(p >= params.min_token_prob for p in got.probs)


def test_longer_and_more_frequent_matches_draft_longer():
    params = SuffixParams(max_depth=24, max_spec_factor=1.0, min_token_prob=0.1)
    body = [5, 6, 7, 8, 9, 10, 11, 12]
    short = body[:2]
    text = body + [1] + short                      # a 2-token match: at most 2 drafts
    assert propose_suffix(with_separator(text), len(text), None, 16, params).tokens == (7, 8)
    text = body + [1] + body[:6]                   # a 6-token match: 6 drafts, on into the copy itself
    assert propose_suffix(with_separator(text), len(text), None, 16, params).tokens == (11, 12, 1, 5, 6, 7)
    rare = [3, 4, 20, 3, 4, 21, 3, 4, 21, 3, 4]    # 21 followed "3 4" twice, 20 once
    draft = propose_suffix(with_separator(rare), len(rare), None, 1, params)
    assert draft.tokens == (21,) and draft.probs == (pytest.approx(2 / 4),)   # its own occurrence counts too


def test_the_cache_of_earlier_outputs_is_bounded_and_indexed():
    rng = random.Random(3)
    cache = SuffixCache(max_requests=5)
    added = []
    for i in range(400):                           # enough to rebuild the index and cut evicted outputs
        output = [rng.randrange(50) for _ in range(rng.randint(1, 60))]
        cache.add(output)
        added.append(output)
        assert cache.num_requests == min(i + 1, 5)
        if i % 37 == 0 or i == 399:
            assert cache.outputs() == added[-5:]
            text = cache.text.tolist()
            live = len(text) - sum(len(o) + 1 for o in added[-5:])
            for token in range(50):
                want = [p for p in range(live, len(text)) if text[p] == token]
                assert cache.ends_of(token).tolist() == want
    assert cache.num_tokens == sum(len(o) + 1 for o in added[-5:])
    assert len(cache.text) < 8 * cache.num_tokens           # evicted outputs were cut off the front
    off = SuffixCache(max_requests=0)
    off.add([1, 2, 3])
    assert off.num_requests == 0 and off.num_tokens == 0


def test_finished_outputs_feed_other_requests_drafts():
    config = SpeculativeConfig.from_json({"method": "suffix", "num_speculative_tokens": 8,
                                          "suffix_decoding_max_cached_requests": 2})
    spec = Speculator(config)
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    for i in range(3):
        done = Sequence(Request(f"old{i}", (1, 2, 3), SamplingParams(max_tokens=50)), [30 + i, *answer])
        spec.retire(done)
    assert spec.cache.num_requests == 2                       # suffix_decoding_max_cached_requests
    fresh = Sequence(Request("new", (9, 8, 7, 40, 41, 42), SamplingParams(max_tokens=50, temperature=0.0)), [43])
    assert spec.drafts(fresh, 20) == tuple(answer[4:8])       # "40 41 42 43" continued: 4 matched, 4 drafts


def test_config_is_read_as_vllm_spells_it():
    config = SpeculativeConfig.from_json('{"method": "suffix", "suffix_decoding_max_tree_depth": 32, '
                                         '"suffix_decoding_max_spec_factor": 2.0, '
                                         '"suffix_decoding_min_token_prob": 0.2, '
                                         '"suffix_decoding_max_cached_requests": 100}')
    assert config.num_speculative_tokens == 32                # vLLM: the tree depth when not given
    assert config.suffix_params == SuffixParams(32, 2.0, 0.2)
    assert SpeculativeConfig.from_json({"method": "suffix"}).num_speculative_tokens == 24
    for bad in ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}',
                '{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}',
                '{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
                '{"method": "suffix", "prompt_lookup_max": 3}',
                '{"method": "ngram", "suffix_decoding_max_tree_depth": 8}',
                '{"method": "suffix", "num_speculative_tokens": 65}'):
        with pytest.raises(ValueError, match="speculative-config"):
            SpeculativeConfig.from_json(bad)


SUFFIX = SpeculativeConfig.from_json({"method": "suffix", "num_speculative_tokens": 6,
                                      "suffix_decoding_max_tree_depth": 12})


@pytest.mark.parametrize("mode", ("colocated", "disaggregated", "adaptive"))
def test_greedy_tokens_identical_with_and_without_suffix_speculation(mode):
    first = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40, 9, 33], seed=1))]
    again = [Request(f"s{i}", r.prompt_token_ids[:len(r.prompt_token_ids) // 3] + (7,), GREEDY)
             for i, r in enumerate(first)]                    # new prompts, continued from the cached outputs
    plain, engine = generate(mode, first + again)
    engine.close()
    spec, engine = generate(mode, first + again, SUFFIX)
    counters, cache, gate = speculator(engine).counters, speculator(engine).cache, speculator(engine).gate
    engine.close()
    assert spec == plain
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0
    assert cache.num_requests == len(first + again)
    assert gate.cost.predict(gate.threads, 2, 0) is not None        # the steps' costs were measured


def test_process_workers_give_the_same_greedy_tokens_with_suffix():
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(echo_prompts([20, 40], seed=2))]
    plain, engine = generate("disaggregated", requests)
    engine.close()
    spec, engine = generate("disaggregated", requests, SUFFIX, workers="process")
    engine.close()
    assert spec == plain
