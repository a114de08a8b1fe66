"""The serving side of a worker's pipe, read and written without ever blocking the event loop.

Frames are `multiprocessing.Connection`'s (a 4-byte big-endian signed length, then the bytes; past
2 GiB a length of -1 and an 8-byte one), so the worker keeps its plain blocking Connection. Here the
socket is non-blocking (uvloop's `add_reader` makes it so in any case): what the socket does not take
at once is written when it is writable again, and a frame that has arrived in part waits for the rest.
"""
from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable

READ_SIZE = 1 << 20
_SHORT, _LONG = struct.Struct("!i"), struct.Struct("!Q")


def frame_header(size: int) -> bytes:
    return _SHORT.pack(size) if size <= 0x7FFFFFFF else _SHORT.pack(-1) + _LONG.pack(size)


class FrameChannel:
    """One non-blocking socket end: `send` queues a frame, `read` returns the frames complete so far."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, on_error: Callable[[], None]) -> None:
        os.set_blocking(fd, False)
        self.fd, self._loop, self._on_error = fd, loop, on_error
        self._in, self._out = bytearray(), bytearray()

    def send(self, payload: bytes) -> None:
        """Queue one frame; raises OSError when the other end is gone."""
        idle = not self._out
        self._out += frame_header(len(payload))
        self._out += payload
        if idle:
            self._write()
            if self._out:
                self._loop.add_writer(self.fd, self._on_writable)

    def _write(self) -> None:
        while self._out:
            try:
                written = os.write(self.fd, self._out)
            except BlockingIOError:
                return
            del self._out[:written]

    def _on_writable(self) -> None:
        try:
            self._write()
        except OSError:
            self._loop.remove_writer(self.fd)
            self._on_error()
            return
        if not self._out:
            self._loop.remove_writer(self.fd)

    def read(self) -> tuple[list[bytes], bool]:
        """(every frame complete so far, whether the other end has closed); raises OSError on a reset."""
        closed = False
        while True:
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                break
            if not chunk:
                closed = True
                break
            self._in += chunk
        frames = []
        while (frame := self._take()) is not None:
            frames.append(frame)
        return frames, closed

    def _take(self) -> bytes | None:
        if len(self._in) < _SHORT.size:
            return None
        size, start = _SHORT.unpack_from(self._in)[0], _SHORT.size
        if size == -1:
            if len(self._in) < _SHORT.size + _LONG.size:
                return None
            size, start = _LONG.unpack_from(self._in, _SHORT.size)[0], _SHORT.size + _LONG.size
        if len(self._in) < start + size:
            return None
        frame = bytes(self._in[start:start + size])
        del self._in[:start + size]
        return frame

    def detach(self) -> None:
        """Stop writing from the loop and make the socket blocking again; what was still queued is dropped
        (the worker is being stopped, killed, or is gone)."""
        self._loop.remove_writer(self.fd)
        self._out.clear()
        os.set_blocking(self.fd, True)
