"""The chat page at `/`: one static file shipped in the package (no build step, nothing fetched from elsewhere)."""
from __future__ import annotations

from functools import cache
from pathlib import Path

from aiohttp import web

PAGE = Path(__file__).with_name("static") / "chat.html"
# the page talks to this server only; its script and style are inline
POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
          "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@cache
def page_bytes() -> bytes:
    return PAGE.read_bytes()


async def chat_page(request: web.Request) -> web.Response:
    return web.Response(body=page_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": POLICY, "Cache-Control": "no-cache"})
