"""`PDSERVE_STEP_TRACE=FILE`: one JSON line per finished step of every actor, for finding where time goes.

Each line: the unit, the step's id, when it was launched and finished (time.monotonic(), seconds), its compute
seconds and CPU threads, its decode and verify rows, the draft tokens it verified, and its prefill chunk tokens.
Steps are what the planner's cost models learn from, so a trace shows what they saw: which thread count each step
ran on (core lending), how large the batches and chunks were, and the host time between steps (the next launch
minus this finish).
Unset (the default), nothing is written and a step pays one attribute test.
"""
from __future__ import annotations

import threading
import time

import orjson

from pdserve import env


class StepTrace:
    """Appends step lines to one file, shared by every actor of the process."""

    _opened: dict[str, "StepTrace"] = {}
    _lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self._file = open(path, "ab", buffering=0)       # NOTE: unbuffered: a killed server keeps its lines

    @classmethod
    def from_environment(cls) -> "StepTrace | None":
        path = env.step_trace_path()
        if path is None:
            return None
        with cls._lock:
            if path not in cls._opened:
                cls._opened[path] = cls(path)
            return cls._opened[path]

    def step(self, unit: str, step_id: int, launched: float, seconds: float, threads: int | None,
             decode_rows: int, verify_rows: int, prefill_tokens: int, draft_tokens: int = 0) -> None:
        self._file.write(orjson.dumps({
            "unit": unit, "step": step_id, "launched": round(launched, 6), "done": round(time.monotonic(), 6),
            "seconds": round(seconds, 6), "threads": threads, "decode_rows": decode_rows,
            "verify_rows": verify_rows, "draft_tokens": draft_tokens, "prefill_tokens": prefill_tokens}) + b"\n")
