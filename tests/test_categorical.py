"""The CPU sampler's inverse-CDF draw against plain torch: a float64 running sum over every column."""
import math

import pytest
import torch

from pdserve.engine.worker.sampling.categorical import BLOCK, sample_categorical


def running_sum(probs: torch.Tensor) -> torch.Tensor:
    return probs.to(torch.float64).cumsum(dim=-1)


@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 41, 49152])
def test_picks_the_column_where_the_full_running_sum_crosses_the_draw(vocab):
    generator = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(64, vocab, generator=generator) * 3).softmax(dim=-1)
    probs[probs < probs.median(dim=-1, keepdim=True).values] = 0.0           # filtered columns
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    chosen = sample_categorical(probs, uniforms)
    ends = running_sum(probs)
    starts = torch.cat([torch.zeros(64, 1, dtype=torch.float64), ends[:, :-1]], dim=1)
    target, slack = uniforms * ends[:, -1], 1e-6 * ends[:, -1]       # block sums are fp32: within 1e-6 of the mass
    rows = torch.arange(64)
    assert (probs[rows, chosen] > 0).all()
    assert (starts[rows, chosen] - slack <= target).all() and (target < ends[rows, chosen] + slack).all()


def test_never_picks_a_column_without_mass_even_at_the_ends_of_the_unit_interval():
    vocab = 2 * BLOCK + 5
    probs = torch.zeros(4, vocab)
    probs[0, 0] = 1.0                      # the first column only
    probs[1, vocab - 1] = 0.3              # the last column only (in the padded block), unnormalized
    probs[2, [BLOCK - 1, BLOCK]] = 0.5     # the two sides of a block boundary
    probs[3, 1:] = 1e-30                   # everything but the first, all tiny
    low, high = torch.zeros(4, dtype=torch.float64), torch.full((4,), math.nextafter(1.0, 0.0), dtype=torch.float64)
    for uniforms in (low, high):
        chosen = sample_categorical(probs, uniforms)
        assert (probs.gather(1, chosen.unsqueeze(1)) > 0).all(), chosen
    assert sample_categorical(probs, low).tolist()[:3] == [0, vocab - 1, BLOCK - 1]
    assert sample_categorical(probs, high).tolist()[:3] == [0, vocab - 1, BLOCK]


def test_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.0, 0.05] + [0.0] * 300)
    draws = 40_000
    chosen = sample_categorical(probs.expand(draws, -1), torch.rand(draws, dtype=torch.float64,
                                                                   generator=torch.Generator().manual_seed(3)))
    counts = torch.bincount(chosen, minlength=len(probs)).double() / draws
    for column, p in enumerate(probs.tolist()):
        assert abs(counts[column].item() - p) < 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (column, counts[column])


def test_a_nan_row_gets_a_column_in_range_and_leaves_the_others_alone():
    probs = torch.zeros(3, BLOCK + 9)
    probs[0] = float("nan")
    probs[1, 5] = probs[2, BLOCK + 3] = 1.0
    chosen = sample_categorical(probs, torch.tensor([0.5, 0.5, 0.99], dtype=torch.float64))
    assert 0 <= chosen[0] < BLOCK + 9 and chosen[1:].tolist() == [5, BLOCK + 3]
