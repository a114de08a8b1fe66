"""The serving side of a worker's pipe: frames much larger than the socket buffer, both ways, under uvloop.

The far end is multiprocessing's own Connection (what the worker process uses), read and written
from a thread, so the framing is checked against code somebody else wrote.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
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


def test_frames_from_a_blocking_connection_are_read_whole_and_in_order():
    here, there = multiprocessing.Pipe(duplex=True)
    payloads = _payloads(2)
    writer = threading.Thread(target=lambda: [there.send_bytes(p) for p in payloads])

    async def receive_all() -> list[bytes]:
        loop = asyncio.get_running_loop()
        channel = FrameChannel(here.fileno(), loop, on_error=pytest.fail)
        frames, ready = [], asyncio.Event()

        def on_readable() -> None:
            got, closed = channel.read()
            frames.extend(got)
            if len(frames) == len(payloads) or closed:
                ready.set()

        loop.add_reader(here.fileno(), on_readable)
        writer.start()
        await asyncio.wait_for(ready.wait(), 60)
        loop.remove_reader(here.fileno())
        channel.detach()
        return frames

    assert _run(receive_all) == payloads
    writer.join()
    here.close(), there.close()


def test_a_frame_that_arrived_in_part_waits_for_the_rest():
    """Connection's own bytes for two frames, written a few bytes at a time: nothing before a frame is whole."""
    payloads = [b"first frame", random.Random(3).randbytes(5000)]
    wire_bytes = _connection_bytes(payloads)
    here, there = multiprocessing.Pipe(duplex=True)

    async def trickle() -> list[list[bytes]]:
        channel = FrameChannel(here.fileno(), asyncio.get_running_loop(), on_error=pytest.fail)
        seen = []
        for start in range(0, len(wire_bytes), 7):
            os.write(there.fileno(), wire_bytes[start:start + 7])
            got, closed = channel.read()
            assert not closed
            seen.append(got)
        channel.detach()
        return seen

    seen = _run(trickle)
    assert [frame for got in seen for frame in got] == payloads
    ends = [i for i, got in enumerate(seen) if got]
    assert ends == [(4 + len(payloads[0]) - 1) // 7, len(seen) - 1]   # each frame the read after its last byte
    here.close(), there.close()


def _connection_bytes(payloads: list[bytes]) -> bytes:
    """What multiprocessing's Connection writes for `payloads`, read raw off the other end."""
    here, there = multiprocessing.Pipe(duplex=True)
    for payload in payloads:
        there.send_bytes(payload)
    expected = sum(4 + len(p) for p in payloads)
    data = b""
    while len(data) < expected:
        data += os.read(here.fileno(), expected - len(data))
    here.close(), there.close()
    return data


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
