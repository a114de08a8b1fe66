"""A step's token masks as the sampler applies them (`StepConstraints.to` + `.apply`) against plain torch:
each bit read on its own and the logits set with masked_fill, bit for bit (nan and infinities included);
and the bitmasks llguidance fills for real grammars, applied as llguidance's own numpy kernel does."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from llguidance.numpy import apply_token_bitmask_inplace

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.text.grammar import json_schema_grammar, regex_grammar
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.engine.worker.sampling.constraints import RowConstraints, StepConstraints, host_disallowed

VOCABS = [1, 31, 32, 33, 1000, 49152]


def reference_apply(logits: torch.Tensor, mask_rows: list[int], bitmask: torch.Tensor,
                    bias: list[tuple[int, int, float]]) -> torch.Tensor:
    """Biases added one by one, then for each grammar row the tokens whose bit is clear set to -inf."""
    out = logits.clone()
    for row, token, value in bias:
        out[row, token] += value
    tokens = torch.arange(out.shape[1])
    for g, row in enumerate(mask_rows):
        allowed = ((bitmask[g, tokens // 32] >> (tokens % 32)) & 1).bool()    # [V]
        out[row] = out[row].masked_fill(~allowed, float("-inf"))
    return out


def random_logits(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Normal logits with a few nan, +inf and -inf entries (masking must leave each bit pattern as torch does)."""
    logits = torch.randn(rows, vocab, generator=generator)
    specials = torch.randint(0, rows * vocab, (max(3, rows * vocab // 50),), generator=generator)
    logits.view(-1)[specials] = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(len(specials))[
        :len(specials)]
    return logits


def random_bitmask(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32: random words, whole words clear or set, and one row with no bit set."""
    words = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=generator, dtype=torch.int64)
    pick = torch.randint(0, 4, words.shape, generator=generator)
    words = torch.where(pick == 0, 0, torch.where(pick == 1, -1, words))
    words[-1] = 0
    return words.to(torch.int32)


def constraints_of(bitmask: torch.Tensor, mask_rows: list[int], batch: int, vocab: int,
                   bias: list[tuple[int, int, float]]) -> StepConstraints:
    every_row = mask_rows == list(range(batch))
    return StepConstraints(
        mask_rows=torch.tensor(mask_rows, dtype=torch.long) if mask_rows and not every_row else None,
        bitmask=bitmask if mask_rows else None,
        bias_index=torch.tensor([(r, t) for r, t, _ in bias], dtype=torch.long).T.contiguous() if bias else None,
        bias_values=torch.tensor([b for _, _, b in bias], dtype=torch.float32) if bias else None,
        mask_seconds=0.0, vocab_size=vocab)


def assert_same_bits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("vocab", VOCABS)
def test_host_unpacking_is_the_bit_of_each_token(vocab):
    generator = torch.Generator().manual_seed(vocab)
    bitmask = random_bitmask(generator, 5, vocab)
    tokens = torch.arange(vocab)
    allowed = ((bitmask[:, tokens // 32] >> (tokens % 32)) & 1).bool()        # [5, V]
    assert torch.equal(host_disallowed(bitmask, vocab), ~allowed)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", ["every", "some", "none"])
def test_applied_masks_and_biases_equal_plain_torch(vocab, rows):
    generator = torch.Generator().manual_seed(vocab * 7 + len(rows))
    batch = 6
    mask_rows = {"every": list(range(batch)), "some": [1, 2, 5], "none": []}[rows]
    bitmask = random_bitmask(generator, len(mask_rows), vocab) if mask_rows else None
    tokens = torch.randint(0, vocab, (4,), generator=generator).tolist()
    bias = [(0, tokens[0], 5.0), (3, tokens[1], -100.0), (3, tokens[1], 2.5), (4, tokens[2], 100.0)]
    logits = random_logits(generator, batch, vocab)
    expected = reference_apply(logits, mask_rows, bitmask, bias)
    ours = logits.clone()
    constraints_of(bitmask, mask_rows, batch, vocab, bias).to(torch.device("cpu")).apply(ours)
    assert_same_bits(ours, expected)


def test_a_bitmask_left_packed_is_refused():
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="unpacks"):
        constraints_of(bitmask, [0, 1], 2, 32, []).apply(torch.zeros(2, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [33, 49152])
@pytest.mark.parametrize("rows", ["every", "some"])
def test_the_device_unpacking_equals_the_host_one(vocab, rows):
    generator = torch.Generator().manual_seed(vocab)
    batch = 6
    mask_rows = list(range(batch)) if rows == "every" else [0, 4]
    bitmask = random_bitmask(generator, len(mask_rows), vocab)
    bias = [(4, 3, 100.0)]
    logits = random_logits(generator, batch, vocab)
    on_host = logits.clone()
    constraints_of(bitmask, mask_rows, batch, vocab, bias).to(torch.device("cpu")).apply(on_host)
    on_device = logits.cuda()
    constraints_of(bitmask, mask_rows, batch, vocab, bias).to(torch.device("cuda")).apply(on_device)
    assert_same_bits(on_device.cpu(), on_host)


SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}


def test_masks_of_real_grammars_apply_as_llguidance_applies_them(smollm2):
    """Rows of a runner with a JSON schema, a regex, a finished regex (EOS only) and none, walked for a few
    greedy steps on random logits: each step equals llguidance's numpy kernel on the same bitmask."""
    _, model_dir = smollm2
    config = ModelConfig.from_dir(model_dir)
    eos = Tokenizer.from_dir(model_dir).eos_token_ids | frozenset(config.eos_token_ids)
    vocab = config.vocab_size
    constraints = RowConstraints(model_dir, vocab, eos)
    grammars = {0: json_schema_grammar(SCHEMA), 2: regex_grammar("[a-z]{2,6}"), 3: regex_grammar("x")}
    for row, grammar in grammars.items():
        constraints.add(row, SamplingParams(max_tokens=16, grammar=grammar), ())
    constraints.add(1, SamplingParams(max_tokens=16), ())
    generator = torch.Generator().manual_seed(0)
    rows = [0, 1, 2, 3]
    for _ in range(6):
        step = constraints.constraints(rows)
        logits = torch.randn(len(rows), vocab, generator=generator)
        expected = logits.numpy().copy()
        for g, row in enumerate(step.mask_rows.tolist()):
            apply_token_bitmask_inplace(expected[row], step.bitmask[g].numpy())
        step.to(torch.device("cpu")).apply(logits)
        assert np.array_equal(logits.numpy(), expected)
        tokens = logits.argmax(dim=-1).tolist()
        constraints.advance(rows, tokens)
    assert np.isfinite(expected[1]).all()                              # the row without a grammar
    assert set(np.flatnonzero(np.isfinite(expected[3])).tolist()) == set(constraints.eos_token_ids)  # "x" done
