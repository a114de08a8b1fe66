"""The actor skeleton: a mailbox, one compute unit, and a pipelined step loop on the event loop.

A step is scheduled and turned into a compact StepInput on the loop, runs on the compute unit
(`pdserve.engine.worker.compute`: a thread, or a worker process), and is recorded back on the loop.
With `overlap`, the next step is scheduled and launched while one runs (two in flight), so host
work hides behind device work; either way a finished step's tokens are published (detokenized
and streamed) only after the next step has been launched.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.engine.actors.mailbox import Mailbox
from pdserve.engine.actors.port import NoPort, Port
from pdserve.engine.actors.recording import Recording
from pdserve.engine.actors.runner_rows import RunnerRows
from pdserve.engine.actors.step_trace import StepTrace
from pdserve.engine.actors.tiering import Tiering
from pdserve.engine.actors.view import UnitView
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import StepOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import Speculator
from pdserve.engine.worker.compute import Compute
from pdserve.engine.worker.step import StepWork
from pdserve.engine.worker.step_runner import StepOutcome

logger = logging.getLogger(__name__)

Emit = Callable[[StepOutput], None]
OnFailure = Callable[["Actor", str], None]


@dataclass(slots=True, eq=False)
class InFlight:
    step_id: int
    batch: Batch
    future: asyncio.Future
    started: float                   # the actor's clock at launch
    threads: int | None = None       # the CPU threads it runs on (None: its unit's own)


class Actor(Recording, UnitView, Tiering, abc.ABC):
    """Subclasses implement `handle`, `schedule`, `record`, `drop`, `clear` and `queue_lengths`.

    Scheduling and bookkeeping run on the event loop; only the step runs on the actor's compute
    unit (a thread pinned to its device or cores, or a worker process). Any exception escaping the
    loop (a step's or the bookkeeping's) ends the actor and is reported to `on_failure`.
    """

    name = "actor"

    def __init__(self, unit: Compute, max_model_len: int, emit: Emit, overlap: bool = False,
                 prefix_caching: bool = False) -> None:
        self.unit = unit
        self.device = unit.device
        self.index = 0                   # its unit's position among the units of its role
        self.unit_name = self.name       # prefill, decode1, colocated0, ... (set when wired)
        self.port: Port = NoPort()
        self.clock: Callable[[], float] = time.monotonic     # the coordinator's, once wired (virtual in a simulator)
        self.routed_prefill = self.routed_decode = 0     # what the coordinator routed here
        self.max_model_len = max_model_len
        self.blocks = BlockManager(unit.num_blocks, unit.block_size, prefix_caching, unit.state_slots, unit.kv_window,
                                   unit.window_slots)
        self.emit = emit
        self.on_failure: OnFailure = lambda actor, error: None
        self.failure: str | None = None
        self.pipeline_depth = 2 if overlap else 1
        self.rows = RunnerRows()
        self.speculator: Speculator | None = None     # decode-side actors that speculate set it
        self.steps = 0
        self.last_step_time = 0.0
        self.step_seconds = 0.0          # schedule + launch + record, summed over steps (host side)
        self.mask_seconds: deque[float] = deque(maxlen=10_000)   # token-mask time of steps that had masks
        self.completed_step = -1
        self.trace = StepTrace.from_environment()
        self.lent_steps = 0              # steps run with cores borrowed from the other actor
        self.local_prefills = self.remote_prefills = 0     # placement decisions (adaptive mode)
        self._next_step = 0
        self._in_flight: deque[InFlight] = deque()
        self._mailbox = Mailbox()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    @property
    def runner(self):
        """The ModelRunner of a thread unit (a worker process keeps its own out of reach)."""
        return self.unit.runner

    # lifecycle
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"pdserve-{self.name}")

    async def stop(self) -> None:
        """Stop stepping once the steps in flight have finished (their results are recorded)."""
        if self._task is None:
            return
        self._stopping = True
        self._wakeup.set()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def abandon(self) -> None:
        """Stop now, dropping the steps in flight (after a failure: this actor is discarded)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None
        self.give_back_tiers()

    def drain(self) -> bool:
        """Apply the messages left in the mailbox (a stopped actor); True if there were any."""
        had_mail = bool(self._mailbox)
        while self._mailbox:
            self.handle(self._mailbox.take())
        return had_mail

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def stepping(self, stall_seconds: float) -> bool:
        """Alive, and not stuck inside one device step for longer than `stall_seconds`."""
        oldest = self._in_flight[0].started if self._in_flight else None
        return self.alive and (oldest is None or self.clock() - oldest < stall_seconds)

    async def steps_done(self) -> None:
        """Until the steps in flight now have finished (their copies are started), whatever their outcome."""
        futures = [step.future for step in self._in_flight]
        if futures:
            await asyncio.wait(futures)

    # messages
    def send(self, message) -> None:
        self._mailbox.put(message)
        self._wakeup.set()

    def poke(self) -> None:
        self._wakeup.set()

    # the step loop
    async def run(self) -> None:
        try:
            await self._step_loop()
        except Exception as e:                    # NOTE: whatever the cause, the supervisor decides
            self.failure = f"{type(e).__name__}: {e}"
            logger.exception("%s actor failed", self.name)
            self.on_failure(self, self.failure)

    async def _step_loop(self) -> None:
        while not self._stopping:
            self.drain()
            if self._launch():
                continue
            if not self._in_flight:
                await self.idle()
                continue
            output = await self._complete_oldest()
            self.drain()
            self._launch()                     # NOTE: the next step runs while this one's tokens are published
            self._publish(output)
        while self._in_flight:
            self._publish(await self._complete_oldest())

    def _launch(self) -> bool:
        if len(self._in_flight) >= self.pipeline_depth or self.waits_for_cores():
            return False
        started = time.perf_counter()
        batch = self.schedule()
        if batch is None:
            if not self.tier_work_waiting:
                return False
            batch = Batch()                    # a step of tier copies alone
        step_id = self._next_step
        self._next_step += 1
        for seq in batch.sequences():
            seq.last_step = step_id
        threads = self.step_threads(batch) if batch.sequences() else None
        work = self.with_tier_copies(replace(self.prepare(batch), threads=threads), step_id)
        future = self.unit.submit(work)
        self._in_flight.append(InFlight(step_id, batch, future, self.clock(), work.threads))
        self.step_seconds += time.perf_counter() - started
        return True

    async def _complete_oldest(self) -> StepOutput | None:
        step = self._in_flight[0]
        outcome = await step.future                # NOTE: a failed step fails the actor (its unit's state is unknown)
        self._step_done(step)
        started = time.perf_counter()
        if step.batch.sequences():
            self.observe_step(step.batch, outcome.seconds, outcome.threads)
        if self.trace is not None:
            self.trace.step(self.unit_name, step.step_id, step.started, self.clock(), outcome.seconds,
                            outcome.threads, step.batch)
        if outcome.mask_seconds:
            self.mask_seconds.append(outcome.mask_seconds)
        self.end_faulted(step.batch, outcome.result.faults)
        self.cache_landed(step.batch)
        self.release_behind_window(step.batch)
        self.tier_copies_done(step.step_id, outcome)
        output = self.record(step.batch, outcome)
        self.steps += 1
        self.step_seconds += time.perf_counter() - started
        self.last_step_time = time.monotonic()
        return output

    def _step_done(self, step: InFlight) -> None:
        self._in_flight.popleft()
        self.completed_step = step.step_id
        if self.blocks.release_through(step.step_id):
            self.blocks_released()

    def blocks_released(self) -> None:
        """Blocks held back for a finished step went back to the free list."""

    def _publish(self, output: StepOutput | None) -> None:
        if output is not None and len(output):
            self.emit(output)

    async def idle(self) -> None:
        """Nothing to schedule: wait for a copy this actor tracks to land, else for a message or a poke."""
        pending = self.pending_transfer()
        if pending is not None and not self._mailbox and not self.waits_for_cores():
            await self.unit.wait(pending)       # NOTE: with its cores lent, it waits for them (a poke) instead
            return
        if not self._mailbox:
            self._wakeup.clear()
            await self._wakeup.wait()

    def pending_transfer(self):
        """A copy whose landing this actor still has to act on, or None (see `first_pending`)."""
        return None

    def waits_for_cores(self) -> bool:
        """Whether another unit steps on this one's cores now (adaptive mode lends them): it launches nothing."""
        return False

    # compute thread
    def prepare(self, batch: Batch) -> StepWork:
        """What the compute unit runs for `batch`, built on the loop."""
        return StepWork(self.rows.step_input(batch, self.blocks.take_window_assignments()))

    def step_threads(self, batch: Batch) -> int | None:
        """CPU threads for `batch`'s step (None: keep the compute thread's own); lending overrides it."""
        return None

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        """A finished step's compute time (the step cost model of adaptive mode listens here)."""
        if self.speculator is not None:
            self.speculator.observe_step(batch, seconds, threads)

    # subclass interface
    @abc.abstractmethod
    def handle(self, message) -> None:
        """Apply one mailbox message (runs on the event loop, between steps)."""

    @abc.abstractmethod
    def schedule(self) -> Batch | None:
        """The next step's batch, or None when there is nothing to run."""

    def record(self, batch: Batch, outcome: StepOutcome) -> StepOutput | None:
        """Record a finished step's results on the loop; returns the tokens to publish.

        By default every sampled sequence gets its token and one that finished leaves (`drop`)."""
        output, recorded = self.record_tokens(batch.sampled, outcome, self.record_prompt_logprobs(batch, outcome))
        if batch.verify:
            output, recorded = self.record_verified(batch, outcome, output, recorded)
        for seq, reason in recorded:
            if reason is not None:
                self.drop(seq)
        return output

    @abc.abstractmethod
    def drop(self, seq: Sequence) -> None:
        """Forget `seq` and free its blocks (it failed or was aborted)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Stopped and drained: end every sequence held, wait for copies in flight, free every block."""

    @abc.abstractmethod
    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences, for stats()."""
