"""What the sampler and the logits processors read from a sequence."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.core.sampling_params import SamplingParams


class SamplingState(Protocol):
    """What the engine's sequence objects provide to the sampler."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far, not the one being sampled
