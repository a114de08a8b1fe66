"""Server-Sent Events: `data: {json}\n\n` per event, `data: [DONE]\n\n` at the end."""
from __future__ import annotations

import orjson
from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"


def encode_event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SSEWriter:
    """One event-stream response. Writes raise ConnectionResetError once the client has gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: dict) -> None:
        await self.response.write(encode_event(obj))

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
