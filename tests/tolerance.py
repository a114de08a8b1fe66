"""How close a float32 result must be to a reference, derived from the arithmetic instead of fitted to one CPU.

Two float32 implementations of the same network sum the same products in different orders (BLAS kernels,
blocking, AVX2 vs AVX-512 vs AMX code paths), so neither is exact: each is off the float64 result by a
rounding error that grows with the model's depth and width. pdserve's float32 forward must be no further
from the float64 result than a small multiple of the reference implementation's own float32 error.
"""
from __future__ import annotations

import copy
import functools

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps
SLACK = 4.0   # float32 rounding error is a sum of O(sqrt(n)) random-walk terms; another order of the same sums lands within a few times it


def float32_error_bound(reference32: torch.Tensor, reference64: torch.Tensor, scale: float | None = None) -> float:
    """`SLACK` times the reference's own float32 error, never below one float32 ulp of the largest value the
    result was computed from (`scale`: the largest logit behind a logprob; else the largest result)."""
    own_error = (reference32.double() - reference64).abs().max().item()
    largest = reference64.abs().max().item() if scale is None else scale
    return SLACK * max(own_error, FLOAT32_EPS * largest)


def assert_float32_close(ours: torch.Tensor, reference32: torch.Tensor, reference64: torch.Tensor,
                         scale: float | None = None) -> None:
    """`ours` (float32) is within `float32_error_bound` of the float64 result `reference64`."""
    assert ours.shape == reference64.shape, (ours.shape, reference64.shape)
    error = (ours.double() - reference64).abs().max().item()
    bound = float32_error_bound(reference32, reference64, scale)
    assert error <= bound, f"max |ours - float64| = {error:.3g} > {bound:.3g} ({SLACK:g}x the reference's float32 error)"


@functools.cache
def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).double().eval()


def reference_logits(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers model's logits for `prompt` in its own float32 and in float64: ([T, V], [T, V])."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return model(ids).logits[0], _float64_copy(model)(ids).logits[0]


def reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The log-probabilities of `tokens` following `prompt`, in float32 and in float64, and the largest logit
    they were computed from (a logprob is a logit minus a log-sum-exp: its rounding error is the logits'):
    ([N], [N], scale)."""
    logits32, logits64 = reference_logits(model, prompt + tokens)
    chosen = torch.tensor(tokens)[:, None]
    steps = slice(len(prompt) - 1, -1)
    logprobs32, logprobs64 = (torch.log_softmax(logits[steps], dim=-1).gather(1, chosen)[:, 0]
                              for logits in (logits32, logits64))
    return logprobs32, logprobs64, logits64[steps].abs().max().item()
