"""Where an actor's steps run: `ThreadCompute` (a thread of this process) or a worker process
(`pdserve.engine.worker.processes.process.ProcessCompute`). Both take a StepWork and give back a future StepOutcome,
and describe the pool they step against, so actors do not know which one they have.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from pdserve.engine.core.state_slots import StateSlots
from pdserve.engine.core.window_slots import WindowSlots
from pdserve.engine.transfer.base import TransferHandle
from pdserve.engine.worker.faults import Fault
from pdserve.engine.worker.model_runner import ModelRunner
from pdserve.engine.worker.openmp import release_thread_pool
from pdserve.engine.worker.step import StepWork
from pdserve.engine.worker.step_runner import PendingOutcome, StepOutcome, StepRunner


class Compute(Protocol):
    kind: str                        # "thread" or "process"
    device: torch.device
    num_blocks: int                  # KV blocks (a model with recurrent layers keeps its state slots after them)
    block_size: int
    eos_token_ids: frozenset[int]
    state_slots: StateSlots | None
    kv_window: int                   # ModelConfig.kv_window: KV blocks behind it go back to the pool
    window_slots: WindowSlots | None # a split_window model's sliding layers' K and V, kept for the window only

    def submit(self, work: StepWork) -> asyncio.Future:
        """Start the step on the unit; the future's result is its StepOutcome (or the step's exception)."""

    async def wait(self, handle: TransferHandle) -> None:
        """Wait, off the loop, for a copy this unit started to land."""

    async def recover(self, force: bool) -> None:
        """Ready for fresh actors after a failure (`force`: even if the unit looks alive, e.g. stuck)."""

    def close(self) -> None: ...


def share_cores(units) -> None:
    """Tell each CPU thread unit which others step on some of its cores (adaptive mode's core lending): before
    it steps on more than one thread, their idle OpenMP pools are given back (`pdserve.engine.worker.openmp`)."""
    threads = [u for u in units if isinstance(u, ThreadCompute) and u.cpu_cores]
    for unit in threads:
        unit.core_neighbours = tuple(o for o in threads if o is not unit and set(o.cpu_cores) & set(unit.cpu_cores))


class ThreadCompute:
    """One compute thread pinned to the runner's device (or, on CPU, to `cpu_cores`).

    On CUDA the compute thread only launches steps; a second thread waits for each step's tokens (its
    read-back event) and resolves the step's future, so the next step's inputs are built and queued
    while the device still runs this one. On CPU a step's work is its launch: one thread does all."""

    kind = "thread"

    def __init__(self, step_runner: StepRunner, name: str, cpu_cores: tuple[int, ...] = ()) -> None:
        self.step_runner = step_runner
        self.runner: ModelRunner = step_runner.runner
        self.device, self.num_blocks = self.runner.device, self.runner.num_blocks
        self.state_slots = self.runner.state_slots
        self.kv_window = self.runner.kv_window
        self.window_slots = self.runner.window_slots
        self.block_size, self.eos_token_ids = self.runner.block_size, self.runner.eos_token_ids
        self.cpu_cores = cpu_cores
        self.fault = Fault.from_env(name)
        self.core_neighbours: tuple[ThreadCompute, ...] = ()    # see share_cores
        self._active = 0                 # steps running on the thread now (0 or 1)
        self._pool_threads = 1           # most threads a step used since the thread's OpenMP pool was given back
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{name}", initializer=self._init_thread)
        self._reader = None
        if step_runner.reads_back_later:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{name}-readback")

    def submit(self, work: StepWork) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if (work.threads or len(self.cpu_cores)) > 1:
            for other in self.core_neighbours:
                other.release_idle_pool()
        if self._reader is None:
            return loop.run_in_executor(self._executor, self._run, work)
        return asyncio.ensure_future(self._read_back(loop.run_in_executor(self._executor, self._launch, work)))

    async def _read_back(self, launched: asyncio.Future) -> StepOutcome:
        pending = await launched
        return await asyncio.get_running_loop().run_in_executor(self._reader, pending.result)

    def _run(self, work: StepWork) -> StepOutcome:
        return self._stepping(self.step_runner.run, work)

    def _launch(self, work: StepWork) -> PendingOutcome:
        return self._stepping(self.step_runner.launch, work)

    def _stepping(self, step, work: StepWork):
        self._active += 1
        try:
            if self.fault is not None:
                self.fault.on_step()
            return step(work)
        finally:
            self._active -= 1
            self._pool_threads = max(self._pool_threads, torch.get_num_threads())

    def release_idle_pool(self) -> None:
        """Give back the thread's OpenMP workers, unless it is stepping (a neighbour borrows its cores)."""
        if self._pool_threads > 1 and not self._active:
            self._pool_threads = 1
            self._executor.submit(release_thread_pool)

    async def wait(self, handle: TransferHandle) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, handle.wait)

    def call(self, fn, *args):
        """`fn(*args)` on the compute thread (its cores and stream), waited for: for work between two steps."""
        return self._executor.submit(fn, *args).result()

    async def recover(self, force: bool) -> None:
        """Nothing to do: a step left running finishes before the next one starts (one thread, in order)."""
        if force:
            raise RuntimeError("a compute thread stuck in a step cannot be reclaimed")

    def close(self) -> None:
        """Stop the thread; one still inside a step (stuck) is left behind rather than waited for."""
        self._executor.shutdown(wait=not self.stepping, cancel_futures=True)
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    @property
    def stepping(self) -> bool:
        return self._active > 0

    def _init_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        elif self.cpu_cores:
            os.sched_setaffinity(0, self.cpu_cores)
            torch.set_num_threads(len(self.cpu_cores))
