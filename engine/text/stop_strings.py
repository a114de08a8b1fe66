"""Stop strings over a text stream (OpenAI semantics: the stop string is never emitted)."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Cuts a text stream at the first stop string, holding back text that may start one.

    The stop string itself is never emitted (OpenAI semantics). When several stop strings
    appear in the same delta, the one that starts earliest wins.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        text = self._pending + delta
        start = min((i for i in (text.find(stop) for stop in self._stops) if i >= 0), default=-1)
        if start >= 0:
            self._pending, self.stopped = "", True
            return text[:start], True
        keep = self._partial_stop_length(text)
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        pending, self._pending = self._pending, ""
        return pending

    def _partial_stop_length(self, text: str) -> int:
        longest = min(len(text), max((len(stop) for stop in self._stops), default=1) - 1)
        for length in range(longest, 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
