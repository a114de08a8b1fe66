"""A launched step whose tokens are on their way to the host: `ModelRunner.launch` returns one.

`result()` is the read-back point: it waits for the step's one device-to-host copy (an event, on
CUDA) and turns the values into a StepResult. Whoever records the step calls it (the actor's side,
off the compute thread), so the compute thread is free to launch the next step meanwhile, as in
mini-sglang's overlap loop and vLLM's async scheduling. It may be called from any thread, any
number of times. The host bookkeeping that needs the tokens (grammar matchers, verified rows'
output counts) is the runner's: `ModelRunner.settle` does it on the compute thread, later.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

from pdserve.engine.transfer.host_copy import ReadBack
from pdserve.engine.worker.prompt_logprobs import ScoredChunks, read_prompt_logprobs
from pdserve.engine.worker.sampling.sampler import unpack
from pdserve.engine.worker.sampling.sampling_table import SamplingBatch
from pdserve.engine.worker.spec_verify import Verified, read_verified
from pdserve.engine.worker.step import StepInput, StepResult


class StepTimer:
    """Device time of a step: CUDA events read after the step landed, or host time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start, self.end = time.perf_counter(), None

    def stop(self) -> None:
        if self.on_cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()

    def seconds(self) -> float:
        """After the step landed (its events are complete then)."""
        return self.start.elapsed_time(self.end) / 1e3 if self.on_cuda else self.end - self.start


class PendingStep:
    def __init__(self, step: StepInput, readback: ReadBack | None = None, timer: StepTimer | None = None,
                 sampled: tuple[tuple[int, ...], SamplingBatch] | None = None,
                 verified: tuple[tuple[int, ...], Verified] | None = None, joins: np.ndarray | None = None,
                 faults: tuple[tuple[int, str], ...] = (), prompt: ScoredChunks | None = None) -> None:
        self.step, self.readback, self.timer, self.faults = step, readback, timer, faults
        self.sampled, self.verified, self.prompt = sampled, verified, prompt
        self.joins = joins               # RowState.joins of the sampled, then the verifying rows, at launch
        self.seconds = 0.0
        self._result: StepResult | None = None
        self._lock = threading.Lock()

    @classmethod
    def done(cls, step: StepInput, result: StepResult) -> PendingStep:
        """A step already run and read (on CPU)."""
        pending = cls(step)
        pending._result = result
        return pending

    @property
    def ready(self) -> bool:
        """Whether `result()` has been read (nothing left to wait for)."""
        return self._result is not None or self.readback is None

    def result(self) -> StepResult:
        """The step's tokens (waits for them to land; never call it inside a step)."""
        with self._lock:
            if self._result is None:
                self._result = self._read()
            return self._result

    def _read(self) -> StepResult:
        if self.readback is None:
            return StepResult(faults=self.faults)
        self.readback.wait()
        tokens, logprobs = (), None
        if self.sampled is not None:
            tokens, logprobs = unpack(self.readback, *self.sampled)
        verified, verified_logprobs = (), None
        if self.verified is not None:
            slots, output = self.verified
            verified, verified_logprobs = read_verified(self.readback, slots, self.step.verify,
                                                        (output.logprob_rows, output.logprob_counts))
        prompt = read_prompt_logprobs(self.readback, self.prompt) if self.prompt is not None else ()
        self.seconds = self.timer.seconds()
        return StepResult(tokens, logprobs, verified, verified_logprobs, self.faults, prompt)
