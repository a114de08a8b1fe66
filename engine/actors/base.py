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
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Protocol

from pdserve.engine.actors.planner import StepPlanner
from pdserve.engine.actors.step_trace import StepTrace
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import ActorStats, FinishReason, Preempted, Request, Reservation, StepOutput
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import Speculator
from pdserve.engine.worker.compute import Compute
from pdserve.engine.worker.step import StepWork
from pdserve.engine.worker.step_runner import StepOutcome

logger = logging.getLogger(__name__)

Emit = Callable[[StepOutput], None]
OnFailure = Callable[["Actor", str], None]
Recorded = list[tuple[Sequence, FinishReason | None]]


class Port(Protocol):
    """What an actor asks of the coordinator (engine.coordinator); no actor holds another actor."""

    def reserve(self, seq: Sequence) -> Reservation | None:
        """Decode blocks for `seq` on a decode unit the coordinator picks, or None (back-pressure)."""

    def post(self, message) -> None:
        """A KVHandoff, Release or Preempted, for the coordinator to deliver."""

    def blocks_freed(self, actor: "Actor") -> None:
        """`actor` freed blocks: a prefill unit held back for room may go on."""

    def place(self, actor: "Actor", seq: Sequence) -> bool:
        """Adaptive mode: True to prefill `seq` on `actor`'s unit; False: the coordinator sent it elsewhere."""

    def step_budget(self, actor: "Actor", decode_rows: int) -> int | None:
        """Adaptive mode: prefill tokens decode unit `actor`'s next step carries (None: a full prefill step)."""

    def prefill_budget(self, actor: "Actor") -> int | None:
        """Adaptive mode: prompt tokens prefill unit `actor`'s next step carries (None: a full prefill step)."""

    def step_threads(self, actor: "Actor", batch: Batch, own: int, total: int) -> int:
        """CPU core lending: threads for `actor`'s next step, its `own` or every one (`total`)."""

    def partner_busy(self, actor: "Actor") -> bool:
        """Whether the unit `actor` would borrow cores from is busy (CPU core lending)."""

    def cores_lent(self, actor: "Actor") -> bool:
        """Whether another unit steps on `actor`'s cores now (lent): `actor` launches nothing until it ends."""

    def cores_returned(self, actor: "Actor") -> None:
        """`actor`'s step on lent cores ended."""


class NoPort:
    """An actor not wired to a coordinator: it reserves nothing and delivers nothing."""

    def reserve(self, seq: Sequence) -> Reservation | None:
        return None

    def post(self, message) -> None:
        pass

    def blocks_freed(self, actor: "Actor") -> None:
        pass

    def place(self, actor: "Actor", seq: Sequence) -> bool:
        return True

    def step_budget(self, actor: "Actor", decode_rows: int) -> int | None:
        return None

    def prefill_budget(self, actor: "Actor") -> int | None:
        return None

    def step_threads(self, actor: "Actor", batch: Batch, own: int, total: int) -> int:
        return own

    def partner_busy(self, actor: "Actor") -> bool:
        return True

    def cores_lent(self, actor: "Actor") -> bool:
        return False

    def cores_returned(self, actor: "Actor") -> None:
        pass


def first_pending(transfers: Iterable):
    """The copy an idle actor waits for: the first not landed, else the first landed one (it landed after
    schedule() and still needs acting on), else None."""
    tracked = list(transfers)
    return next((t for t in tracked if not t.done()), tracked[0] if tracked else None)


@dataclass(slots=True, eq=False)
class InFlight:
    step_id: int
    batch: Batch
    future: asyncio.Future
    started: float                   # the actor's clock at launch
    threads: int | None = None       # the CPU threads it runs on (None: its unit's own)


class Actor(abc.ABC):
    """Subclasses implement `handle`, `schedule`, `record`, `drop`, `settle` and `queue_lengths`.

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
        self.blocks = BlockManager(unit.num_blocks, unit.block_size, enable_caching=prefix_caching)
        self.emit = emit
        self.on_failure: OnFailure = lambda actor, error: None
        self.failure: str | None = None
        self.pipeline_depth = 2 if overlap else 1
        self.plan = StepPlanner()
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
        self._mailbox: deque = deque()
        self._inbound: dict[str, int] = {}      # prompts sent here and not yet handled: id -> tokens to compute
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

    def drain(self) -> bool:
        """Apply the messages left in the mailbox (a stopped actor); True if there were any."""
        had_mail = bool(self._mailbox)
        while self._mailbox:
            message = self._mailbox.popleft()
            if self._inbound and (prompt := _prompt_of(message)) is not None:
                self._inbound.pop(prompt[0], None)
            self.handle(message)
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

    @property
    def step_started_at(self) -> float | None:
        return self._in_flight[0].started if self._in_flight else None

    @property
    def steps_in_flight(self) -> tuple[InFlight, ...]:
        """The steps launched and not yet finished, oldest (the one running) first."""
        return tuple(self._in_flight)

    @property
    def prefill_tokens_in_flight(self) -> int:
        """Prompt tokens the steps in flight prefill: scheduled, so no longer in `backlog_tokens`."""
        return sum(step.batch.chunk_tokens for step in self._in_flight)

    # messages
    def send(self, message) -> None:
        prompt = _prompt_of(message)
        if prompt is not None:
            self._inbound[prompt[0]] = prompt[1]
        self._mailbox.append(message)
        self._wakeup.set()

    def backlog_tokens(self) -> int:
        """Prompt tokens queued here for prefill, those still in the mailbox included (a burst is routed
        before this actor's loop has handled any of it)."""
        queued = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.prefill_queue())
        return queued + sum(self._inbound.values())

    def prefill_queue(self) -> Iterator[Sequence]:
        """The sequences waiting here for (more of) their prefill."""
        return iter(())

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
        if len(self._in_flight) >= self.pipeline_depth or self.port.cores_lent(self):
            return False
        started = time.perf_counter()
        batch = self.schedule()
        if batch is None:
            return False
        step_id = self._next_step
        self._next_step += 1
        for seq in batch.sequences():
            seq.last_step = step_id
        work = replace(self.prepare(batch), threads=self.step_threads(batch))
        future = self.unit.submit(work)
        self._in_flight.append(InFlight(step_id, batch, future, self.clock(), work.threads))
        self.step_seconds += time.perf_counter() - started
        return True

    async def _complete_oldest(self) -> StepOutput | None:
        step = self._in_flight[0]
        outcome = await step.future                # NOTE: a failed step fails the actor (its unit's state is unknown)
        self._step_done(step)
        started = time.perf_counter()
        self.observe_step(step.batch, outcome.seconds, outcome.threads)
        if self.trace is not None:
            batch = step.batch
            self.trace.step(self.unit_name, step.step_id, step.started, outcome.seconds, outcome.threads,
                            len(batch.decode), len(batch.verify), batch.chunk_tokens,
                            batch.num_drafts)
        if outcome.mask_seconds:
            self.mask_seconds.append(outcome.mask_seconds)
        self.end_faulted(step.batch, outcome.result.faults)
        self.cache_landed(step.batch)
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
        if pending is not None and not self._mailbox and not self.port.cores_lent(self):
            await self.unit.wait(pending)       # NOTE: with its cores lent, it waits for them (a poke) instead
            return
        if not self._mailbox:
            self._wakeup.clear()
            await self._wakeup.wait()

    def pending_transfer(self):
        """A copy whose landing this actor still has to act on, or None (see `first_pending`)."""
        return None

    # compute thread
    def prepare(self, batch: Batch) -> StepWork:
        """What the compute unit runs for `batch`, built on the loop."""
        return StepWork(self.plan.step_input(batch))

    def step_threads(self, batch: Batch) -> int | None:
        """CPU threads for `batch`'s step (None: keep the compute thread's own); lending overrides it."""
        return None

    def observe_step(self, batch: Batch, seconds: float, threads: int) -> None:
        """A finished step's compute time (the step cost model of adaptive mode listens here)."""
        if self.speculator is not None:
            self.speculator.observe_step(batch, seconds, threads)

    # bookkeeping shared by the actors
    def end_faulted(self, batch: Batch, faults: tuple[tuple[int, str], ...]) -> None:
        """End each sequence whose own data failed (its runner row's in this finished step, or its drafts'): its
        request gets an error and its blocks go; the unit serves on."""
        failed = self.speculator.take_faulty() if self.speculator is not None else []
        if faults:
            by_row = dict(faults)
            failed += [(seq, by_row[seq.row]) for seq in batch.sequences() if seq.row in by_row]
        for seq, why in failed:
            if not seq.done:
                logger.warning("%s: request %s failed alone: %s", self.unit_name, seq.request_id, why)
                self.emit(StepOutput((seq.request_id,), (-1,), (FinishReason.ERROR,), error=f"request failed: {why}"))
                self.drop(seq)

    def cache_landed(self, batch: Batch) -> None:
        """Register in the prefix cache the blocks this finished step filled (their KV now exists)."""
        if not self.blocks.enable_caching:
            return
        size = self.blocks.block_size
        for seq, landed in batch.landed():
            full = landed // size
            if not seq.done and full > seq.num_registered_blocks:
                hashes = extend_hashes(seq, full * size, size)[:full]     # NOTE: admission may have hashed more
                self.blocks.register(seq.request_id, hashes, seq.num_registered_blocks)
                seq.num_registered_blocks = full

    def record_tokens(self, seqs: Seq[Sequence], outcome: StepOutcome) -> tuple[StepOutput, Recorded]:
        """Append each live sequence's sampled token; the output to publish and who finished why."""
        ids, tokens, reasons, logprobs, cached, recorded = [], [], [], [], [], []
        result = outcome.result
        eos, limit, all_logprobs = self.unit.eos_token_ids, self.max_model_len, result.logprobs
        for i, seq in enumerate(seqs):
            if seq.done:                           # left while the step ran: its token is dropped
                continue
            token = result.token_ids[i]
            seq.num_in_flight -= 1
            seq.output_token_ids.append(token)
            reason = seq.finish_reason(eos, limit)
            ids.append(seq.request_id)
            tokens.append(token)
            reasons.append(reason)
            logprobs.append(all_logprobs[i] if all_logprobs else None)
            cached.append(seq.num_cached_tokens)
            recorded.append((seq, reason))
        output = StepOutput(tuple(ids), tuple(tokens), tuple(reasons), tuple(logprobs) if all_logprobs else None,
                            cached_tokens=tuple(cached) if any(cached) else None)
        return output, recorded

    def record_verified(self, batch: Batch, outcome: StepOutcome, output: StepOutput,
                        recorded: Recorded) -> tuple[StepOutput, Recorded]:
        """Append each verifying sequence's kept drafts and next token, up to where it finishes."""
        ids, tokens, reasons = list(output.request_ids), list(output.token_ids), list(output.finish_reasons)
        logprobs = list(output.logprobs or (None,) * len(output))
        eos, limit, result = self.unit.eos_token_ids, self.max_model_len, outcome.result
        for seq, emitted, row_logprobs in zip(batch.verify, result.verified,
                                              result.verified_logprobs or (None,) * len(batch.verify)):
            if seq.done:                           # left while the step ran: its tokens are dropped
                continue
            seq.num_in_flight -= 1
            self.speculator.settle(seq, self.blocks, len(emitted) - 1)
            for j, token in enumerate(emitted):
                seq.output_token_ids.append(token)
                reason = seq.finish_reason(eos, limit)
                ids.append(seq.request_id)
                tokens.append(token)
                reasons.append(reason)
                logprobs.append(row_logprobs[j] if row_logprobs else None)
                if reason is not None:
                    break
            recorded.append((seq, reason))
        cached = output.cached_tokens and output.cached_tokens + (0,) * (len(ids) - len(output))
        return StepOutput(tuple(ids), tuple(tokens), tuple(reasons), tuple(logprobs) if any(logprobs) else None,
                          cached_tokens=cached), recorded

    def leave(self, seq: Sequence) -> None:
        """`seq` is done on this actor: its runner row goes, its blocks are freed (once no step holds them)."""
        seq.done = True
        self.plan.release_row(seq)
        if seq.last_step > self.completed_step:
            self.blocks.free_after(seq.request_id, seq.last_step)
        else:
            self.blocks.free(seq.request_id)

    def stats(self) -> ActorStats:
        running, waiting = self.queue_lengths()
        b = self.blocks
        return ActorStats(self.name, running=running, waiting=waiting, kv_blocks_used=b.num_used,
                          kv_blocks_total=b.num_blocks, steps=self.steps, last_step_time=self.last_step_time,
                          alive=self.alive, prefix_cache_queries=b.prefix_queries, prefix_cache_hits=b.prefix_hits,
                          role=self.role(), lent_steps=self.lent_steps, local_prefills=self.local_prefills,
                          remote_prefills=self.remote_prefills, unit=self.unit_name,
                          routed_prefill=self.routed_prefill, routed_decode=self.routed_decode,
                          **self._spec_stats())

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_drafts": c.num_drafts, "spec_draft_tokens": c.num_draft_tokens,
                "spec_accepted_tokens": c.num_accepted_tokens,
                "spec_accepted_per_position": tuple(c.accepted_per_position)}

    def role(self) -> str:
        """What this actor's compute does now (adaptive mode lends it; the fixed modes keep their role)."""
        return self.name

    @property
    def busy(self) -> bool:
        """Has sequences to run, a step in flight or messages not yet handled (a prompt sent to it)."""
        running, waiting = self.queue_lengths()
        return bool(running or waiting or self._in_flight or self._mailbox)

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
        output, recorded = self.record_tokens(batch.sampled, outcome)
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
    def settle(self) -> None:
        """Stopped and drained: end every sequence held, wait for copies in flight, free every block."""

    @abc.abstractmethod
    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences, for stats()."""



def _prompt_of(message) -> tuple[str, int] | None:
    """(request id, tokens to compute) of a prompt sent to an actor; None for any other message."""
    if isinstance(message, Preempted):
        return message.request.request_id, len(message.request.prompt_token_ids) + len(message.output_token_ids)
    if isinstance(message, Request):
        return message.request_id, len(message.prompt_token_ids)
    return None
