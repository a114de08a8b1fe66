"""`pdserve chat`: a terminal chat with any OpenAI-compatible server, each answer streamed as it comes.

A line is a message; `/reset` forgets the conversation, `/exit` (or end of input) leaves. Ctrl-C stops the answer
being streamed. Reasoning (reasoning_content) is shown dimmed before the answer, tool calls after it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import ssl
import sys
from contextlib import suppress

import aiohttp
import orjson

from pdserve import env

DIM, RESET = "\033[2m", "\033[0m"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--model", default=None, help="the model to ask (default: the server's first)")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--api-key", default=env.api_key() or os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY, else $OPENAI_API_KEY)")
    parser.add_argument("--temperature", type=float, default=None, help="(default: the server's)")
    parser.add_argument("--max-tokens", type=int, default=None, help="(default: the server's)")
    parser.add_argument("--ca-certs", default=None, help="CA certificates to trust for an https --url")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(Chat(args).loop())
    except (aiohttp.ClientError, OSError, ChatError) as e:
        print(f"pdserve chat: {e}", file=sys.stderr)
        return 1


class ChatError(Exception):
    pass


class Chat:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.url.rstrip("/")
        self.history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        self.styled = sys.stdout.isatty()
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def loop(self) -> int:
        ssl_context = ssl.create_default_context(cafile=self.args.ca_certs) if self.args.ca_certs else None
        connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context else None
        async with aiohttp.ClientSession(headers=self.headers, connector=connector) as self.session:
            model = self.args.model or await self._first_model()
            if sys.stdin.isatty():
                print(f"chatting with {model} at {self.url}; /reset forgets, /exit leaves", file=sys.stderr)
            while (line := await self._read_line()) is not None:
                if line.strip() == "/exit":
                    break
                if line.strip() == "/reset":
                    del self.history[1 if self.args.system else 0:]
                elif line.strip():
                    await self._turn(model, line.strip())
        return 0

    async def _read_line(self) -> str | None:
        if sys.stdin.isatty():
            print("> ", end="", flush=True, file=sys.stderr)
        line = await asyncio.to_thread(sys.stdin.readline)
        return line or None

    async def _first_model(self) -> str:
        async with self.session.get(f"{self.url}/v1/models") as response:
            models = await _json(response)
        if not models.get("data"):
            raise ChatError(f"{self.url} serves no model")
        return models["data"][0]["id"]

    async def _turn(self, model: str, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        task = asyncio.ensure_future(self._stream(model))
        loop = asyncio.get_running_loop()
        with suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            answer = await task
        except asyncio.CancelledError:
            answer = ""
            print("\n[stopped]", file=sys.stderr)
        finally:
            with suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
        self.history.append({"role": "assistant", "content": answer})

    async def _stream(self, model: str) -> str:
        body = {"model": model, "messages": self.history, "stream": True}
        body |= {k: v for k, v in (("temperature", self.args.temperature), ("max_tokens", self.args.max_tokens))
                 if v is not None}
        answer, thinking = [], False
        async with self.session.post(f"{self.url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                await _json(response)
            async for delta in _deltas(response):
                if reasoning := delta.get("reasoning_content") or delta.get("reasoning"):
                    self._write(reasoning, dim=True)
                    thinking = True
                if content := delta.get("content"):
                    if thinking:
                        self._write("\n")
                        thinking = False
                    answer.append(content)
                    self._write(content)
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    self._write(f"\n[tool call {function.get('name') or ''}] {function.get('arguments') or ''}")
        self._write("\n")
        return "".join(answer)

    def _write(self, text: str, dim: bool = False) -> None:
        sys.stdout.write(f"{DIM}{text}{RESET}" if dim and self.styled else text)
        sys.stdout.flush()


async def _deltas(response: aiohttp.ClientResponse):
    """The deltas of the first choice of an SSE chat stream."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = orjson.loads(line[6:])
        if "error" in event:
            raise ChatError(event["error"].get("message", "the server failed the request"))
        for choice in event.get("choices") or ():
            yield choice.get("delta") or {}


async def _json(response: aiohttp.ClientResponse) -> dict:
    answer = await response.json(content_type=None)
    if response.status != 200:
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        raise ChatError(f"{response.status}: {message or response.reason}")
    return answer
