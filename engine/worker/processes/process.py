"""`--workers process`: an actor's runner in its own spawned worker process.

The coordinator (the event loop: server, schedulers, block managers, detokenizer) sends one
`pdserve.engine.worker.processes.wire` message per step over a pipe and reads the replies from a reader the loop
registers on it, so neither side's Python work waits on the other's interpreter lock. A worker
that exits (a crash, SIGKILL) fails the steps it held; `recover` spawns it again onto the same
shared pools.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections import deque
from multiprocessing import resource_tracker

import torch

from pdserve.engine.transfer.base import TransferHandle
from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.processes.frames import FrameChannel
from pdserve.engine.transfer.cuda_ipc import CudaIpcHandle
from pdserve.engine.worker.processes.shared_pool import SharedFd
from pdserve.engine.worker.step import StepWork
from pdserve.engine.worker.processes.worker_process import WorkerSpec, worker_main

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 5.0


class WorkerDied(RuntimeError):
    pass


class WorkerStepError(RuntimeError):
    """A step raised inside the worker (the message names the original exception)."""


class SpawnTracker:
    """multiprocessing's resource tracker, which every spawn starts. It exits by itself only after
    this process has (when its pipe closes), so it would briefly outlive a stopped server; closing
    it last, after the workers, stops it and reaps it. The next spawn starts it again."""

    def close(self) -> None:
        stop = getattr(resource_tracker._resource_tracker, "_stop", None)
        if stop is not None:
            stop()


class ProcessCompute:
    kind = "process"

    def __init__(self, spec: WorkerSpec, own_pool: SharedFd | CudaIpcHandle | None = None,
                 peer_pools: tuple[SharedFd | CudaIpcHandle, ...] = ()) -> None:
        self.spec, self.own_pool, self.peer_pools = spec, own_pool, peer_pools
        self.device = torch.device(spec.device)
        self.num_blocks, self.block_size = spec.pool.num_blocks, spec.pool.layout.block_size
        self.state_slots = spec.state_slots()
        self.kv_window = spec.model_config.kv_window
        self.window_slots = spec.window_slots()
        if self.state_slots is not None:
            self.num_blocks = self.state_slots.first_block
        if self.window_slots is not None:
            self.num_blocks = self.window_slots.first_block
        self.eos_token_ids = spec.eos_token_ids
        self._context = multiprocessing.get_context("spawn")
        self._pending: deque[asyncio.Future] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: FrameChannel | None = None     # the pipe once the loop reads it (non-blocking)
        self.process = None
        self.conn = None
        self.spawn()

    # lifecycle
    def spawn(self) -> None:
        """Start the worker; returns once it is spawned (`wait_ready` waits for its runner)."""
        parent, child = self._context.Pipe(duplex=True)
        self.process = self._context.Process(target=worker_main, name=f"pdserve-{self.spec.name}", daemon=True,
                                             args=(child, self.spec, os.getpid(), self.own_pool, self.peer_pools))
        self.process.start()
        child.close()
        self.conn = parent

    def wait_ready(self) -> None:
        """Block until the worker has built its runner; RuntimeError with its reason if it could not."""
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"the {self.spec.name} worker did not start within {START_TIMEOUT_S:g} s")
        try:
            kind, doc = wire.decode_message(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join()
            raise RuntimeError(f"the {self.spec.name} worker exited while starting "
                               f"(exit code {self.process.exitcode})") from None
        if kind != wire.READY:
            self.process.join(STOP_GRACE_S)
            raise RuntimeError(f"the {self.spec.name} worker could not start: {doc['error']}")
        logger.info("%s worker ready (pid %d)", self.spec.name, doc["pid"])

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive() and self.conn is not None

    # steps
    def submit(self, work: StepWork) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_exception(WorkerDied(self._death()))
            return future
        self._listen()
        try:
            self._channel.send(wire.encode_work(work))
        except OSError:
            future.set_exception(WorkerDied(self._death()))
            return future
        self._pending.append(future)
        return future

    def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._channel = FrameChannel(self.conn.fileno(), loop, self._on_death)
            loop.add_reader(self.conn.fileno(), self._on_readable)
            self._loop = loop

    def _on_readable(self) -> None:
        try:
            frames, closed = self._channel.read()
        except OSError:
            frames, closed = [], True
        for frame in frames:
            self._resolve(frame)
        if closed:
            self._on_death()

    def _resolve(self, data: bytes) -> None:
        future = self._pending.popleft()
        if future.cancelled():
            return
        try:
            kind, doc = wire.decode_message(data)
            if kind == wire.ERROR:
                future.set_exception(WorkerStepError(f"in the {self.spec.name} worker: {doc['error']}"))
            else:
                future.set_result(wire.decode_outcome(data))
        except wire.WireError as e:
            future.set_exception(e)

    def _on_death(self) -> None:
        self._unlisten()
        self.process.join(STOP_GRACE_S)
        reason = self._death()
        logger.error("%s", reason)
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(WorkerDied(reason))
        self.conn.close()
        self.conn = None

    def _death(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"the {self.spec.name} worker (pid {self.pid}) died: {how}"

    def _unlisten(self) -> None:
        """The loop stops reading and writing the pipe, which is blocking again."""
        if self._loop is not None and self.conn is not None:
            self._loop.remove_reader(self.conn.fileno())
            try:
                self._channel.detach()
            except OSError:
                pass
        self._loop, self._channel = None, None

    async def wait(self, handle: TransferHandle) -> None:
        """Copies have landed before a worker answers; nothing to wait for."""

    async def recover(self, force: bool) -> None:
        """A worker that died, or (`force`) one stuck in a step, is killed and spawned again."""
        if self.alive and not force:                      # NOTE: replies to abandoned steps still arrive, in
            return                                        # order, and resolve their own (cancelled) futures
        self.kill()
        self.spawn()
        await asyncio.to_thread(self.wait_ready)

    def kill(self) -> None:
        self._unlisten()
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        while self._pending:
            self._pending.popleft().cancel()

    def close(self) -> None:
        """Ask the worker to stop, then kill it if it has not within STOP_GRACE_S."""
        self._unlisten()
        if self.conn is not None:
            try:
                self.conn.send_bytes(wire.encode_message(wire.STOP))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(STOP_GRACE_S)
        self.kill()
