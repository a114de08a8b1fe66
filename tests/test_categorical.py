"""The CPU sampler's inverse-CDF draw against plain torch: a float64 running sum over every column."""
import math

import pytest
import torch

from engine.worker.categorical import BLOCK, sample_categorical


def reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    ends = probs.to(torch.float64).cumsum(dim=-1)
    return torch.searchsorted(ends, (uniforms * ends[:, -1]).unsqueeze(1), right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 41, 49152])
def test_equals_the_full_running_sum(vocab):
    generator = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(64, vocab, generator=generator) * 3).softmax(dim=-1)
    probs[probs < probs.median(dim=-1, keepdim=True).values] = 0.0           # filtered columns
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    assert torch.equal(sample_categorical(probs, uniforms), reference(probs, uniforms))


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
