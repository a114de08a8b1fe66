"""The actor skeleton: a mailbox, one compute thread, and a step loop on the event loop."""
from __future__ import annotations

import abc
import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.core.batch import Batch
from engine.core.block_manager import BlockManager
from engine.core.messages import ActorStats, FinishReason, SampledToken, TokenLogprob
from engine.core.sequence import Sequence
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

Emit = Callable[[SampledToken], None]


class Actor(abc.ABC):
    """Subclasses implement `handle`, `schedule`, `execute` (compute thread) and `postprocess`.

    Scheduling and bookkeeping run on the event loop; only `execute` runs on
    the actor's own thread, which is pinned to its device (or, on CPU, to its cores).
    """

    name = "actor"

    def __init__(self, runner: ModelRunner, max_model_len: int, emit: Emit,
                 cpu_cores: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.device = runner.device
        self.max_model_len = max_model_len
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.emit = emit
        self.cpu_cores = cpu_cores
        self.steps = 0
        self.last_step_time = 0.0
        self.step_seconds = 0.0          # schedule + execute + postprocess, summed over steps
        self.step_started_at: float | None = None   # time.monotonic() while a step runs on the device
        self._mailbox: deque = deque()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{self.name}",
                                            initializer=self._init_thread)

    # lifecycle
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"pdserve-{self.name}")

    async def stop(self) -> None:
        """Stop stepping once the step in flight has finished (its results are recorded)."""
        if self._task is None:
            return
        self._stopping = True
        self._wakeup.set()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    def drain(self) -> bool:
        """Apply the messages left in the mailbox (a stopped actor); True if there were any."""
        had_mail = bool(self._mailbox)
        while self._mailbox:
            self.handle(self._mailbox.popleft())
        return had_mail

    @abc.abstractmethod
    def settle(self) -> None:
        """Stopped and drained: end every sequence held, wait for copies in flight, free every block."""

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def stepping(self, stall_seconds: float) -> bool:
        """Alive, and not stuck inside one device step for longer than `stall_seconds`."""
        started = self.step_started_at
        return self.alive and (started is None or time.monotonic() - started < stall_seconds)

    # messages
    def send(self, message) -> None:
        self._mailbox.append(message)
        self._wakeup.set()

    def poke(self) -> None:
        self._wakeup.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            while self._mailbox:
                self.handle(self._mailbox.popleft())
            started = time.perf_counter()
            batch = self.schedule()
            if batch is None:
                await self.idle(loop)
                continue
            self.step_started_at = time.monotonic()
            try:
                result = await loop.run_in_executor(self._executor, self.execute, batch)
            except Exception as e:                     # a failed step fails its sequences, not the actor
                logger.exception("%s step failed", self.name)
                self.fail(batch, f"{type(e).__name__}: {e}")
                continue
            finally:
                self.step_started_at = None
            self.postprocess(batch, result)
            self.steps += 1
            self.step_seconds += time.perf_counter() - started
            self.last_step_time = time.monotonic()

    async def idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to schedule: wait for a copy this actor tracks to land, else for a message or a poke."""
        pending = self.pending_transfer()
        if pending is not None and not self._mailbox:
            await loop.run_in_executor(self._executor, pending.wait)
            return
        if not self._mailbox:
            self._wakeup.clear()
            await self._wakeup.wait()

    def pending_transfer(self):
        """A copy whose landing this actor still has to act on, or None."""
        return None

    def record_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> FinishReason | None:
        """Append a sampled token, stream it, and say whether the sequence is finished."""
        seq.output_token_ids.append(token_id)
        reason = seq.finish_reason(self.runner.eos_token_ids, self.max_model_len)
        self.emit(SampledToken(seq.request_id, token_id, logprob, reason))
        return reason

    def stats(self) -> ActorStats:
        running, waiting = self.queue_lengths()
        return ActorStats(self.name, running=running, waiting=waiting, kv_blocks_used=self.blocks.num_used,
                          kv_blocks_total=self.blocks.num_blocks, steps=self.steps,
                          last_step_time=self.last_step_time, alive=self.alive)

    def fail(self, batch: Batch, error: str) -> None:
        for chunk in batch.chunks:
            self.drop(chunk.seq)
            self.emit(SampledToken(chunk.seq.request_id, -1, finish_reason=FinishReason.ERROR, error=error))

    # compute thread
    def _init_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        elif self.cpu_cores:
            os.sched_setaffinity(0, self.cpu_cores)
            torch.set_num_threads(len(self.cpu_cores))

    # subclass interface
    @abc.abstractmethod
    def handle(self, message) -> None:
        """Apply one mailbox message (runs on the event loop, between steps)."""

    @abc.abstractmethod
    def schedule(self) -> Batch | None:
        """The next step's batch, or None when there is nothing to run."""

    @abc.abstractmethod
    def execute(self, batch: Batch):
        """Run `batch` on the device (compute thread); returns what postprocess needs."""

    @abc.abstractmethod
    def postprocess(self, batch: Batch, result) -> None:
        """Record the step's results and emit tokens (event loop)."""

    @abc.abstractmethod
    def drop(self, seq) -> None:
        """Forget `seq` and free its blocks (it failed or was aborted)."""

    @abc.abstractmethod
    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences, for stats()."""
