"""The serving side of a worker's pipe: frames much larger than the socket buffer, both ways, under uvloop.

The far end is multiprocessing's own Connection (what the worker process uses), read and written
from a thread, so the framing is checked against code somebody else wrote.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import random
import threading

import pytest
import uvloop

from pdserve.engine.worker.processes.frames import FrameChannel

BIG = 8 << 20           # far past a socketpair's buffer (about 200 KiB on Linux)


def _payloads(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for size in (0, 1, 3, BIG, 4096, BIG // 3 + 7)]


def _run(coroutine_fn):
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine_fn())


def test_uvloop_makes_a_plain_connection_fail_on_a_large_frame():
    """Why the channel exists: once uvloop reads the pipe, Connection.send_bytes of a large frame raises."""
    here, there = multiprocessing.Pipe(duplex=True)

    async def send_big() -> None:
        asyncio.get_running_loop().add_reader(here.fileno(), lambda: None)
        with pytest.raises(BlockingIOError):
            here.send_bytes(b"x" * BIG)
        asyncio.get_running_loop().remove_reader(here.fileno())

    _run(send_big)
    here.close(), there.close()


def test_frames_larger_than_the_socket_buffer_reach_a_blocking_connection_whole():
    here, there = multiprocessing.Pipe(duplex=True)
    payloads, received = _payloads(1), []
    reader = threading.Thread(target=lambda: received.extend(there.recv_bytes() for _ in payloads))
    reader.start()

    async def send_all() -> None:
        channel = FrameChannel(here.fileno(), asyncio.get_running_loop(), on_error=pytest.fail)
        for payload in payloads:
            channel.send(payload)
        while reader.is_alive():
            await asyncio.sleep(0.01)
        channel.detach()

    _run(send_all)
    reader.join()
    assert received == payloads
    here.close(), there.close()


def test_frames_that_arrive_in_parts_are_returned_once_whole_and_in_order():
    here, there = multiprocessing.Pipe(duplex=True)
    payloads = _payloads(2)
    writer = threading.Thread(target=lambda: [there.send_bytes(p) for p in payloads])

    async def receive_all() -> tuple[list[bytes], int]:
        loop = asyncio.get_running_loop()
        channel = FrameChannel(here.fileno(), loop, on_error=pytest.fail)
        frames, reads, ready = [], 0, asyncio.Event()

        def on_readable() -> None:
            nonlocal reads
            got, closed = channel.read()
            frames.extend(got)
            reads += 1
            if len(frames) == len(payloads) or closed:
                ready.set()

        loop.add_reader(here.fileno(), on_readable)
        writer.start()
        await asyncio.wait_for(ready.wait(), 60)
        loop.remove_reader(here.fileno())
        channel.detach()
        return frames, reads

    frames, reads = _run(receive_all)
    writer.join()
    assert frames == payloads
    assert reads > len(payloads)          # the large frames came in several reads
    here.close(), there.close()


def test_a_closed_far_end_reads_as_closed_after_its_last_frames():
    here, there = multiprocessing.Pipe(duplex=True)
    there.send_bytes(b"last words")
    there.close()

    async def read_once() -> tuple[list[bytes], bool]:
        channel = FrameChannel(here.fileno(), asyncio.get_running_loop(), on_error=pytest.fail)
        result = channel.read()
        channel.detach()
        return result

    assert _run(read_once) == ([b"last words"], True)
    here.close()
