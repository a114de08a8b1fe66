"""Simulated compute units: they take the StepWork the real actors build, answer with a fixed token per
sampled row, and finish after the seconds a cost model gives, on the loop's (virtual) clock."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from pdserve.engine.sim.cost import step_shape
from pdserve.engine.worker.step import StepResult, StepWork
from pdserve.engine.worker.step_runner import StepOutcome


@dataclass(slots=True)
class Timeline:
    """One resource that does one thing at a time (a device, a core set, a link): when it is next free."""

    free_at: float = 0.0

    def book(self, now: float, seconds: float) -> float:
        """Run `seconds` of work as soon as both `now` and the resource allow; returns when it ends."""
        self.free_at = max(now, self.free_at) + seconds
        return self.free_at


@dataclass(slots=True)
class CoreSet:
    """The cores of a core set (one entry for a GPU), each free at its own time: units that lend each other
    their cores share one, so two one-thread steps run side by side and a two-thread step waits for both."""

    free_at: list[float]

    def book(self, now: float, seconds: float, threads: int, after: float = 0.0) -> float:
        """Run `seconds` on the `threads` cores free soonest, once they all are and not before `after`."""
        count = min(max(threads, 1), len(self.free_at))
        chosen = sorted(range(len(self.free_at)), key=self.free_at.__getitem__)[:count]
        end = max(now, after, *(self.free_at[i] for i in chosen)) + seconds
        for i in chosen:
            self.free_at[i] = end
        return end


class SimHandle:
    """A simulated KV copy: done once the clock passes its end."""

    __slots__ = ("nbytes", "end", "seconds", "_loop")

    def __init__(self, nbytes: int, end: float, seconds: float, loop: asyncio.AbstractEventLoop) -> None:
        self.nbytes, self.end, self.seconds, self._loop = nbytes, end, seconds, loop

    def done(self) -> bool:
        return self._loop.time() >= self.end

    def wait(self) -> None:
        """Only called when the actors settle at shutdown: the clock no longer matters."""


@dataclass(frozen=True, slots=True)
class UnitModel:
    """What a simulated unit is: its pool, the token it answers with, its cost model and its resources."""

    device: torch.device
    num_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    token_id: int
    cost: object                     # cost.Roofline or cost.FittedCost
    cores: CoreSet                   # shared with the units on the same device or core set
    links: tuple[Timeline, ...]      # one per decode unit a prefill unit copies to (KVCopy.peer)
    block_bytes: int
    threads: int = 1


class SimCompute:
    """A `pdserve.engine.worker.compute.Compute` whose steps take modelled time on the virtual clock."""

    kind = "thread"

    def __init__(self, model: UnitModel) -> None:
        self.model = model
        self.device, self.num_blocks, self.block_size = model.device, model.num_blocks, model.block_size
        self.state_slots = None                  # NOTE: simulated steps keep no state
        self.kv_window = 0                       # NOTE: simulated tables hold every block
        self.window_slots = None
        self.eos_token_ids = model.eos_token_ids
        self.steps: list[tuple[float, float]] = []     # (start, seconds) of every step, for the report
        self.busy_until = 0.0                          # one step at a time, as a unit's compute thread runs them

    def submit(self, work: StepWork) -> asyncio.Future:
        loop, m = asyncio.get_running_loop(), self.model
        threads = work.threads or m.threads
        seconds = m.cost.seconds(step_shape(work.step), threads)
        synchronous = getattr(m.cost, "synchronous_copies", False)
        copy_seconds = [m.cost.transfer_seconds(len(c.src_blocks) * m.block_bytes) for c in work.copies]
        seconds += sum(copy_seconds) if synchronous else 0.0
        end = self.busy_until = m.cores.book(loop.time(), seconds, threads, after=self.busy_until)
        self.steps.append((end - seconds, seconds))
        copies = tuple((c.key, self._copy(loop, c, end, s, synchronous)) for c, s in zip(work.copies, copy_seconds))
        token = m.token_id
        result = StepResult(token_ids=(token,) * len(work.step.sampled_rows),
                            verified=tuple((token,) for _ in work.step.verify))
        future = loop.create_future()
        loop.call_at(end, _resolve, future, StepOutcome(result, copies, seconds, threads))
        return future

    def _copy(self, loop, copy, step_end: float, seconds: float, synchronous: bool) -> SimHandle:
        nbytes = len(copy.src_blocks) * self.model.block_bytes
        if synchronous:
            return SimHandle(nbytes, step_end, seconds, loop)
        return SimHandle(nbytes, self.model.links[copy.peer].book(step_end, seconds), seconds, loop)

    async def wait(self, handle: SimHandle) -> None:
        await asyncio.sleep(max(handle.end - asyncio.get_running_loop().time(), 0.0))

    async def recover(self, force: bool) -> None:
        """A simulated unit never fails."""

    def close(self) -> None:
        pass


def _resolve(future: asyncio.Future, outcome: StepOutcome) -> None:
    if not future.done():
        future.set_result(outcome)
