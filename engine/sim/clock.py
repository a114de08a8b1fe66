"""An asyncio event loop on a virtual clock: `time()` is simulated seconds, and where the loop would sleep
until its next timer it jumps the clock there instead. Callbacks run in the same order as on a real loop."""
from __future__ import annotations

import asyncio
import selectors


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is set, yet the simulation has not finished: it would wait forever."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)                 # the loop's own wake-up pipe; nothing else is registered
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStalled("the simulated engine waits for an event that nothing will send")
        self._loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector loop whose clock starts at 0 and moves only to the next timer's deadline."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)


def run_virtual(coroutine):
    """Run `coroutine` to completion on a fresh VirtualClockLoop; returns its result."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coroutine)
