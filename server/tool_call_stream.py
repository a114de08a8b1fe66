"""A streamed choice's tool calls: the content shown while calls may be starting, and the calls' deltas."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.server.tool_calls import (HERMES_START, HERMES_END, ToolCall, Tools, new_call_id, parse_auto,
                                       read_call)


@dataclass(slots=True)
class _OpenCall:
    """A forced call whose arguments are being streamed: where they were sent to, and the JSON scan's state."""

    index: int
    sent_to: int                     # end of the arguments text sent so far
    scanned_to: int                  # end of the text scanned for the arguments' end
    depth: int = 0
    in_string: bool = False
    escaped: bool = False


CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')   # the forced grammar's compact JSON


class ToolCallStream:
    """What one streamed choice shows while its tool calls are being written, as `tool_calls` delta entries
    (each with its `index`, the first of a call with its id and name). A forced choice streams each call's
    arguments as they are written, once its name is; `auto` with hermes sends a whole call as soon as its
    `</tool_call>` comes; content is shown until a call may have started; `finish` parses the whole text and
    sends the calls not sent yet (llama3_json's all). `sent`: the calls started so far."""

    def __init__(self, tools: Tools, parser: str) -> None:
        self.tools, self.parser = tools, parser
        self.text, self.shown = "", 0
        self.scanned = 0                 # end of the last call read (forced: 0 before the array)
        self.sent = 0
        self.open: _OpenCall | None = None

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to show now, tool_calls delta entries to send now)."""
        self.text += delta
        if self.tools.forced:
            return "", self._forced_deltas()
        safe = self._safe_length()
        shown, self.shown = self.text[self.shown:safe], max(self.shown, safe)
        return shown, self._whole(self._closed_hermes_calls()) if self.parser == "hermes" else []

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not shown yet, the delta entries not sent yet)."""
        if self.tools.forced:
            deltas = self._forced_deltas()
            return ("", deltas) if self.sent else (self.text, [])
        content, calls = parse_auto(self.text, self.parser, self.tools.names)
        if not calls:
            return self.text[self.shown:], []
        return content[self.shown:] if len(content) > self.shown else "", self._whole(calls[self.sent:])

    def _whole(self, calls: list[ToolCall]) -> list[dict]:
        deltas = [call.body(self.sent + i) for i, call in enumerate(calls)]
        self.sent += len(calls)
        return deltas

    def _closed_hermes_calls(self) -> list[ToolCall]:
        """Calls of offered tools in `<tool_call>` blocks closed since the last look."""
        calls = []
        while (start := self.text.find(HERMES_START, self.scanned)) >= 0:
            end = self.text.find(HERMES_END, start)
            if end < 0:
                break
            body = self.text[start + len(HERMES_START):end].strip()
            if (call := read_call(body, self.tools.names, "arguments")):
                calls.append(call)
            self.scanned = end + len(HERMES_END)
        return calls

    def _forced_deltas(self) -> list[dict]:
        """The forced array's news: a call's id and name once `{"name":...,"arguments":` is written, then its
        arguments text up to the `}` that closes the call (the grammar writes compact JSON, the name first)."""
        deltas: list[dict] = []
        while True:
            if self.open is None and not self._open_next(deltas):
                return deltas
            end = self._arguments_end(self.open)
            stop = len(self.text) if end is None else end
            if stop > self.open.sent_to:
                _add_arguments(deltas, self.open.index, self.text[self.open.sent_to:stop])
                self.open.sent_to = stop
            if end is None:
                return deltas
            self.scanned, self.open = end + 1, None

    def _open_next(self, deltas: list[dict]) -> bool:
        at = self.scanned
        if self.text[at:at + 1] != ("[" if at == 0 else ","):
            return False
        head = CALL_HEAD.match(self.text, at + 1)
        if head is None:
            return False
        deltas.append(ToolCall(json.loads(head.group(1)), "", new_call_id()).body(self.sent))
        self.open = _OpenCall(self.sent, head.end(), head.end())
        self.sent += 1
        return True

    def _arguments_end(self, call: _OpenCall) -> int | None:
        """Where the call's closing `}` is (the arguments end before it); None while they are still open."""
        for at in range(call.scanned_to, len(self.text)):
            char = self.text[at]
            if call.in_string:
                call.escaped, call.in_string = (False, True) if call.escaped else (char == "\\", char != '"')
            elif char == '"':
                call.in_string = True
            elif char in "{[":
                call.depth += 1
            elif char in "}]":
                if call.depth == 0:
                    return at
                call.depth -= 1
        call.scanned_to = len(self.text)
        return None

    def _safe_length(self) -> int:
        """How much of the text cannot be part of a tool call."""
        if self.parser == "llama3_json":
            stripped = self.text.lstrip()
            return 0 if not stripped or stripped[0] in "{<" else len(self.text)
        start = self.text.find(HERMES_START)
        if start >= 0:
            return start
        for keep in range(min(len(HERMES_START) - 1, len(self.text)), 0, -1):
            if HERMES_START.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)


def _add_arguments(deltas: list[dict], index: int, text: str) -> None:
    """Arguments text for call `index`: into this chunk's entry of that call when it has one (one entry per call)."""
    if deltas and deltas[-1]["index"] == index:
        deltas[-1]["function"]["arguments"] += text
    else:
        deltas.append({"index": index, "function": {"arguments": text}})
