"""The device-resident sampling path (CUDA) gives what the host path (CPU) gives.

On a GPU a SamplingTable keeps its rows' parameters on the device and gathers them there; on CPU it
gathers from its host arrays. On `tests.fake_cuda` the device path runs with real values (its
tensors are CPU tensors that say cuda:1), so both paths are compared here on the same logits:
every batch field, the tokens and logprobs of rows whose draw is deterministic, the filtered
distributions of random rows (CUDA sorts every row; CPU takes the top-256 shortcut), and draft
verification with its logprobs.
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.transfer.host_copy import ReadBack
from pdserve.engine.worker.sampling.sampler import Sampler
from pdserve.engine.worker.sampling.sampling_table import SamplingTable
from pdserve.engine.worker.spec_verify import read_back_into, read_verified, verify_on_device, with_logprobs
from pdserve.engine.worker.step import VerifyInput
from tests.fake_cuda import fake_cuda

VOCAB, EOS = 600, 2
CUDA1 = torch.device("cuda:1")
DETERMINISTIC = [SamplingParams(temperature=0.0),
                 SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.5),
                 SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(4, 9), logprobs=3),
                 SamplingParams(temperature=0.0, logprobs=0)]
RANDOM = [SamplingParams(temperature=0.8, top_k=7),
          SamplingParams(temperature=0.7, top_p=0.8, seed=5),
          SamplingParams(temperature=6.0, top_k=300, top_p=0.95),           # a nucleus beyond the top 256
          SamplingParams(temperature=0.9, repetition_penalty=1.2, seed=1, logprobs=2)]


def table_on(device: torch.device, params: list[SamplingParams]) -> SamplingTable:
    table = SamplingTable(VOCAB, frozenset({EOS}), device)
    generator = torch.Generator().manual_seed(3)
    for row, p in enumerate(params):
        prompt = torch.randint(0, VOCAB, (30,), generator=generator).tolist()
        outputs = torch.randint(0, VOCAB, (row,), generator=generator).tolist()
        table.add(row, p, prompt, outputs)
    return table


def logits_for(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(11)) * 3


def on_host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def test_the_device_batch_holds_the_host_batch_values(monkeypatch):
    params = DETERMINISTIC + RANDOM
    rows = np.array([5, 0, 7, 2, 3, 6, 1, 4])
    host = table_on(torch.device("cpu"), params).batch(rows)
    with fake_cuda(monkeypatch):
        device = table_on(CUDA1, params).batch(rows)
        fields = {name: getattr(device, name) for name in device.__slots__}
        assert all(v.device == CUDA1 for v in fields.values() if isinstance(v, torch.Tensor))
    for name, value in fields.items():
        expected = getattr(host, name)
        if name == "logprob_index":
            assert on_host(value).tolist() == list(host.logprob_rows)
        elif isinstance(expected, torch.Tensor):
            assert torch.equal(on_host(value), expected), name
        elif isinstance(expected, np.ndarray):
            assert np.array_equal(value, expected), name
        else:
            assert value == expected, name


def test_deterministic_rows_sample_the_same_tokens_and_logprobs_on_both_paths(monkeypatch):
    logits = logits_for(len(DETERMINISTIC))
    host = Sampler(VOCAB, frozenset({EOS}))(logits, [_state(p, row) for row, p in enumerate(DETERMINISTIC)])
    with fake_cuda(monkeypatch):
        states = [_state(p, row) for row, p in enumerate(DETERMINISTIC)]
        device = Sampler(VOCAB, frozenset({EOS}))(logits.to(CUDA1), states)
    assert device == host
    assert host[2][0] not in (EOS, 4, 9) and host[2][1] is not None and len(host[2][1].top) == 3


def test_random_rows_draw_from_the_same_distributions_on_both_paths(monkeypatch):
    rows = np.arange(len(RANDOM))
    logits = logits_for(len(RANDOM))
    sampler = Sampler(VOCAB, frozenset({EOS}))
    table = table_on(torch.device("cpu"), RANDOM)
    batch = table.batch(rows)
    expected = sampler.probabilities(sampler.processed(logits, batch), batch)
    with fake_cuda(monkeypatch):
        table = table_on(CUDA1, RANDOM)
        batch = table.batch(rows)
        got = sampler.probabilities(sampler.processed(logits.to(CUDA1), batch), batch).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert ((expected[:3] > 0).sum(1) < VOCAB).all(), "the filters cut each filtered row"


def test_verification_on_both_paths_keeps_the_same_drafts_with_the_same_logprobs(monkeypatch):
    params = DETERMINISTIC
    logits = logits_for(13)
    argmax = logits.argmax(1).tolist()
    rows = [VerifyInput(0, 30, (1, argmax[0], argmax[1], 5)),            # two drafts kept, the third not
            VerifyInput(1, 30, (1, 3)),
            VerifyInput(2, 30, (1, argmax[6], 8, 8, 8)),
            VerifyInput(3, 30, (1, 4))]

    def verified(device):
        table = table_on(device, params)
        readback = ReadBack(device)
        output = with_logprobs(verify_on_device(Sampler(VOCAB, frozenset({EOS})), table, logits.to(device), rows),
                               logits.to(device), table, rows)
        slots = read_back_into(readback, output)
        readback.start()
        readback.wait()
        return read_verified(readback, slots, rows, (output.logprob_rows, output.logprob_counts))

    host = verified(torch.device("cpu"))
    with fake_cuda(monkeypatch):
        device = verified(CUDA1)
    assert device == host
    tokens, logprobs = host
    assert tokens[0][:2] == (argmax[0], argmax[1]) and len(tokens[0]) == 3
    assert logprobs[0] is None and logprobs[1] is None and len(logprobs[2]) == len(tokens[2])
    assert [lp.token_id for lp in logprobs[3]] == list(tokens[3])


def _state(params: SamplingParams, row: int):
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(3)
    prompt = outputs = None
    for r in range(row + 1):
        prompt = torch.randint(0, VOCAB, (30,), generator=generator).tolist()
        outputs = torch.randint(0, VOCAB, (r,), generator=generator).tolist()
    return SimpleNamespace(params=params, prompt_token_ids=prompt, output_token_ids=outputs)
