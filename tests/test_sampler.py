"""Sampler against plain-torch / plain-Python references on random logits (CPU)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.worker.sampling.penalties import apply_penalties
from pdserve.engine.worker.sampling.sampler import Sampler
from pdserve.engine.worker.sampling.sampling_table import SamplingTable
from pdserve.engine.worker.sampling.seeded_noise import seeded_exponential, seeded_uniforms

VOCAB = 1000
PADDED = 1024
EOS = 2


@dataclass
class Seq:
    params: SamplingParams
    prompt_token_ids: tuple[int, ...] = (5, 6, 7)
    output_token_ids: tuple[int, ...] = field(default_factory=tuple)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def random_logits(rows: int, vocab: int = PADDED, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


# --- greedy and padding -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax_and_leaves_logits_alone(dtype):
    logits = random_logits(16, seed=1).to(dtype)
    before = logits.clone()
    tokens = Sampler(VOCAB, frozenset({EOS}))(logits, [Seq(greedy()) for _ in range(16)])
    assert [t for t, _ in tokens] == logits[:, :VOCAB].argmax(dim=-1).tolist()
    assert all(lp is None for _, lp in tokens)
    assert torch.equal(logits, before)


def test_penalized_path_leaves_unpadded_fp32_logits_alone():
    logits = random_logits(4, vocab=VOCAB, seed=2)
    before = logits.clone()
    seqs = [Seq(SamplingParams(repetition_penalty=2.0, min_tokens=3, logprobs=2), output_token_ids=(9,))
            for _ in range(4)]
    Sampler(VOCAB, frozenset({EOS}))(logits, seqs)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [
    greedy(), greedy(logprobs=5), SamplingParams(), SamplingParams(top_k=5),
    SamplingParams(top_p=0.9), SamplingParams(min_p=0.1, seed=3), greedy(repetition_penalty=1.5),
])
def test_padded_vocab_columns_never_chosen(params):
    logits = random_logits(256, seed=3)
    logits[:, VOCAB:] = 1e4
    results = Sampler(VOCAB, frozenset({EOS}))(logits, [Seq(params) for _ in range(256)])
    assert all(token < VOCAB for token, _ in results)
    for _, logprob in results:
        assert logprob is None or all(token < VOCAB for token, _ in logprob.top)


def test_empty_batch():
    assert Sampler(VOCAB, frozenset({EOS}))(torch.zeros(0, PADDED), []) == []


# --- top-k / top-p / min-p ----------------------------------------------------------------------

def reference_distribution(logits: list[float], temperature: float, top_k: int, top_p: float,
                           min_p: float) -> dict[int, float]:
    """vLLM order in plain Python: temperature, top-k, top-p (nucleus), min-p; renormalized."""
    scaled = [value / temperature for value in logits]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    kept = order[:top_k] if top_k > 0 else order
    probs = _softmax({t: scaled[t] for t in kept})
    nucleus, mass = [], 0.0
    for token in kept:
        nucleus.append(token)
        mass += probs[token]
        if mass >= top_p:
            break
    probs = _renormalize({t: probs[t] for t in nucleus})
    best = max(probs.values())
    return _renormalize({t: p for t, p in probs.items() if p >= min_p * best})


def _softmax(logits: dict[int, float]) -> dict[int, float]:
    top = max(logits.values())
    return _renormalize({t: math.exp(v - top) for t, v in logits.items()})


def _renormalize(weights: dict[int, float]) -> dict[int, float]:
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 4, 1.0, 0.0), (0.7, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.15), (1.0, 8, 0.8, 0.05),
    (1.0, -1, 1.0, 0.0), (2.0, 0, 0.3, 0.0),
])
def test_filters_keep_allowed_set_and_renormalized_frequencies(temperature, top_k, top_p, min_p):
    vocab, draws = 12, 20_000
    row = (torch.linspace(-2.0, 2.0, vocab) + torch.rand(vocab, generator=torch.Generator().manual_seed(4)) * 0.1)
    row = row[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))]
    expected = reference_distribution(row.tolist(), temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(6)
    results = Sampler(vocab, frozenset())(row.expand(draws, vocab), [Seq(params)] * draws)
    counts = Counter(token for token, _ in results)
    assert set(counts) <= set(expected)
    for token, p in expected.items():
        sigma = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[token] / draws - p) < 5 * sigma + 2e-3, (token, counts[token] / draws, p)


def test_top_p_always_keeps_the_best_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]]).expand(500, 4)
    params = SamplingParams(top_p=0.01)
    results = Sampler(4, frozenset())(logits, [Seq(params)] * 500)
    assert {token for token, _ in results} == {0}


# --- seeds --------------------------------------------------------------------------------------

def run_seeded(params: SamplingParams, row: torch.Tensor, batch_size: int, slot: int,
               steps: int = 12, neighbours: tuple[SamplingParams, ...] = ()) -> list[int]:
    """Generate `steps` tokens for a seeded sequence sitting at `slot` in a batch of others."""
    sampler, tokens = Sampler(VOCAB, frozenset({EOS})), []
    others = [neighbours[i % len(neighbours)] if neighbours else SamplingParams()
              for i in range(batch_size - 1)]
    for step in range(steps):
        torch.manual_seed(1000 + step * 7 + batch_size)  # the default generator must not matter
        seqs = [Seq(p, output_token_ids=(1,) * (i + step)) for i, p in enumerate(others)]
        seqs.insert(slot, Seq(params, output_token_ids=tuple(tokens)))
        batch = random_logits(batch_size, seed=50 + step)
        batch[slot] = row
        tokens.append(sampler(batch, seqs)[slot][0])
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(seed=1234), SamplingParams(seed=99, top_k=50), SamplingParams(seed=-7, top_p=0.95),
    SamplingParams(seed=5, temperature=0.8, min_p=0.01, repetition_penalty=1.1),
])
def test_same_seed_same_tokens_across_batch_compositions(params):
    row = random_logits(1, seed=7, scale=0.5)[0]
    alone = run_seeded(params, row, batch_size=1, slot=0)
    neighbours = (SamplingParams(seed=3), greedy(), SamplingParams(top_p=0.5, logprobs=3),
                  greedy(frequency_penalty=0.5), SamplingParams(top_k=3, min_p=0.2))
    crowded = run_seeded(params, row, batch_size=7, slot=4, neighbours=neighbours)
    last = run_seeded(params, row, batch_size=3, slot=2, neighbours=(SamplingParams(),))
    assert alone == crowded == last
    assert len(set(alone)) > 1  # the position changes the draw


def test_different_seeds_differ_and_unseeded_follow_default_generator():
    row = random_logits(1, seed=8, scale=0.5)[0]
    first = run_seeded(SamplingParams(seed=1), row, batch_size=1, slot=0)
    second = run_seeded(SamplingParams(seed=2), row, batch_size=1, slot=0)
    assert first != second
    logits = row.expand(2, PADDED)
    sampler, seqs = Sampler(VOCAB, frozenset()), [Seq(SamplingParams())] * 2
    draws = []
    for _ in range(2):
        torch.manual_seed(11)
        draws.append([t for t, _ in sampler(logits, seqs)] + [t for t, _ in sampler(logits, seqs)])
    assert draws[0] == draws[1]


@pytest.mark.parametrize("draw", [lambda s, p: seeded_exponential(s, p, 4096), seeded_uniforms],
                         ids=["exponential noise (CUDA)", "uniforms (CPU)"])
def test_seeded_draws_depend_only_on_seed_and_position(draw):
    seeds, positions = torch.tensor([5, 5, 9, 5, -3]), torch.tensor([0, 1, 0, 0, 0])
    values = draw(seeds, positions)
    assert torch.equal(values[0], values[3])
    assert not any(torch.equal(values[0], values[i]) for i in (1, 2, 4))
    many = draw(torch.arange(2000), torch.zeros(2000, dtype=torch.long))
    expected_mean = 1.0 if many.dim() == 2 else 0.5      # Exp(1) noise, or U[0, 1)
    assert (many >= 0).all() and abs(many.double().mean().item() - expected_mean) < 0.02


# --- penalties ----------------------------------------------------------------------------------

def reference_penalties(logits: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.params
        for token in set(seq.prompt_token_ids) | set(seq.output_token_ids):
            value = out[row, token].item()
            out[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token, count in Counter(seq.output_token_ids).items():
            out[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def sampling_batch(seqs, vocab: int):
    table = SamplingTable(vocab, frozenset({EOS}), torch.device("cpu"))
    for row, seq in enumerate(seqs):
        table.add(row, seq.params, seq.prompt_token_ids, seq.output_token_ids)
    return table.batch(np.arange(len(seqs)))


def penalty_batch(vocab: int) -> list[Seq]:
    gen = torch.Generator().manual_seed(9)
    ids = lambda n, hi: tuple(torch.randint(0, hi, (n,), generator=gen).tolist())  # noqa: E731
    return [
        Seq(greedy(repetition_penalty=1.8), ids(30, vocab), ids(12, 40)),
        Seq(greedy(frequency_penalty=0.7, presence_penalty=-0.4), ids(5, vocab), ids(40, 20)),
        Seq(greedy(), ids(10, vocab), ids(10, 30)),  # no penalty: row untouched
        Seq(greedy(repetition_penalty=0.6, frequency_penalty=-1.2, presence_penalty=1.5),
            ids(50, 60), ids(25, 30)),
        Seq(greedy(presence_penalty=2.0), ids(7, vocab), ()),  # nothing generated yet
    ]


def test_penalties_match_per_row_python_reference():
    seqs = penalty_batch(VOCAB)
    logits = random_logits(len(seqs), vocab=VOCAB, seed=10)
    expected = reference_penalties(logits, seqs)
    actual = logits.clone()
    apply_penalties(actual, sampling_batch(seqs, VOCAB))
    torch.testing.assert_close(actual, expected)
    assert torch.equal(actual[2], logits[2])


def test_penalized_greedy_is_argmax_of_reference():
    seqs = penalty_batch(64)  # small vocab: penalties move the argmax
    logits = random_logits(len(seqs), vocab=80, seed=11, scale=1.0)
    expected = reference_penalties(logits[:, :64], seqs).argmax(dim=-1).tolist()
    results = Sampler(64, frozenset({EOS}))(logits, seqs)
    assert [t for t, _ in results] == expected


# --- min_tokens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_then_releases(ignore_eos):
    stop = 7
    logits = random_logits(1, vocab=64, seed=12)
    logits[0, EOS], logits[0, stop] = 50.0, 40.0
    params = greedy(min_tokens=3, stop_token_ids=(stop, 999), ignore_eos=ignore_eos, max_tokens=8)
    sampler = Sampler(60, frozenset({EOS}))
    masked = logits[0, :60].clone()
    masked[[EOS, stop]] = float("-inf")
    for generated in range(3):
        token, _ = sampler(logits, [Seq(params, output_token_ids=(1,) * generated)])[0]
        assert token == masked.argmax().item()
    assert sampler(logits, [Seq(params, output_token_ids=(1, 1, 1))])[0][0] == EOS
    sampled = SamplingParams(min_tokens=2, stop_token_ids=(stop,), max_tokens=4)
    results = sampler(logits.expand(2000, 64), [Seq(sampled, output_token_ids=(4,))] * 2000)
    assert not {token for token, _ in results} & {EOS, stop}
    released = sampler(logits.expand(50, 64), [Seq(sampled, output_token_ids=(4, 4))] * 50)
    assert {token for token, _ in released} == {EOS}


# --- logprobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_sorted_top(dtype):
    logits = random_logits(5, seed=13).to(dtype)
    params = [greedy(logprobs=0), greedy(logprobs=5, repetition_penalty=3.0),
              SamplingParams(logprobs=20, temperature=0.5, top_k=10), SamplingParams(),
              SamplingParams(logprobs=1, min_tokens=2, seed=4)]
    seqs = [Seq(p, output_token_ids=(3, 3, 9) if i == 1 else ()) for i, p in enumerate(params)]
    results = Sampler(VOCAB, frozenset({EOS}))(logits, seqs)
    reference = torch.log_softmax(logits[:, :VOCAB].float(), dim=-1)
    for row, (token, logprob) in enumerate(results):
        n = params[row].logprobs
        if n is None:
            assert logprob is None
            continue
        assert logprob.token_id == token
        assert logprob.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
        values, ids = reference[row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in logprob.top] == ids.tolist()
        assert [v for _, v in logprob.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(logprob.top, logprob.top[1:]))


# --- everything at once -------------------------------------------------------------------------

def test_mixed_batch_matches_single_row_calls():
    logits = random_logits(7, seed=14)
    seqs = [
        Seq(greedy()),
        Seq(greedy(repetition_penalty=1.5, frequency_penalty=0.3), output_token_ids=(11, 11, 12)),
        Seq(SamplingParams(seed=21, top_p=0.9), output_token_ids=(1, 2)),
        Seq(SamplingParams(top_k=3)),
        Seq(SamplingParams(seed=8, logprobs=4, presence_penalty=1.0, min_p=0.05), output_token_ids=(5,)),
        Seq(greedy(min_tokens=4, logprobs=2)),
        Seq(SamplingParams(temperature=0.3, seed=77, top_k=40, top_p=0.8)),
    ]
    logits[5, EOS] = 100.0
    sampler = Sampler(VOCAB, frozenset({EOS}))
    batched = sampler(logits, seqs)
    for row, seq in enumerate(seqs):
        if seq.params.seed is None and not seq.params.greedy:
            top3 = set(logits[row, :VOCAB].topk(3).indices.tolist())
            assert batched[row][0] in top3 and batched[row][1] is None
            continue
        alone = sampler(logits[row:row + 1], [seq])[0]
        assert alone[0] == batched[row][0]
        if alone[1] is None:
            assert batched[row][1] is None
        else:
            assert [t for t, _ in alone[1].top] == [t for t, _ in batched[row][1].top]
            assert [v for _, v in alone[1].top] == pytest.approx([v for _, v in batched[row][1].top])
            assert alone[1].logprob == pytest.approx(batched[row][1].logprob)
    assert batched[0][0] == logits[0, :VOCAB].argmax().item()
    assert batched[5][0] != EOS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_for_greedy_and_is_seed_stable():
    logits = random_logits(6, seed=15)
    logits[4:] = logits[2]
    seqs = [Seq(greedy()), Seq(greedy(repetition_penalty=1.3), output_token_ids=(4,)),
            Seq(SamplingParams(seed=3, top_p=0.9)), Seq(SamplingParams(logprobs=3))] + \
           [Seq(SamplingParams(seed=3, top_p=0.9))] * 2
    sampler = Sampler(VOCAB, frozenset({EOS}))
    cpu, cuda = sampler(logits, seqs), sampler(logits.cuda(), seqs)
    assert [t for t, _ in cpu[:2]] == [t for t, _ in cuda[:2]]
    assert cuda[2][0] == cuda[4][0] == cuda[5][0] == sampler(logits[2:3].cuda(), seqs[2:3])[0][0]
    assert cuda[3][1].logprob == pytest.approx(
        torch.log_softmax(logits[3, :VOCAB], -1)[cuda[3][0]].item(), abs=1e-4)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_candidate_nucleus_equals_the_full_sort(scale):
    from pdserve.engine.worker.sampling.sampling_filters import top_k_top_p, top_k_top_p_sorted

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(12, 3000, generator=generator) * scale
    x[3, :400] = 5.0                                    # a tie across the candidate edge
    top_k = torch.tensor([3000, 40, 3000, 300, 1, 3000, 257, 3000, 2999, 3000, 10, 3000])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1.0, 0.99, 0.999, 0.8, 0.05, 0.7, 1.0])
    expected = top_k_top_p_sorted(x, top_k, top_p)
    got = top_k_top_p(x, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)], rtol=0, atol=0)
