"""`PDSERVE_STEP_TRACE=FILE`: one JSON line per finished step of every actor, for finding where time goes.

Each line: the unit, the step's id, when it was launched and finished (the actor's clock: virtual in a simulation,
so a simulated run's trace reads like a served one's), its compute seconds and CPU threads, and its work in the
counts a step's cost is fitted to (decode rows and their summed context, prefill chunk tokens and the attention
pairs they read, verify rows and drafts). Steps are what the planner's cost models learn from, so a trace shows
what they saw: which thread count each step ran on (core lending), how large the batches and chunks were, and the
host time between steps (the next launch minus this finish).
Unset (the default), nothing is written and a step pays one attribute test.
"""
from __future__ import annotations

import threading

import orjson

from pdserve import env
from pdserve.engine.core.batch import Batch


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

    def step(self, unit: str, step_id: int, launched: float, done: float, seconds: float, threads: int | None,
             batch: Batch) -> None:
        self._file.write(orjson.dumps({
            "unit": unit, "step": step_id, "launched": round(launched, 6), "done": round(done, 6),
            "seconds": round(seconds, 6), "threads": threads, "decode_rows": len(batch.decode),
            "decode_context": sum(batch.decode_positions) + len(batch.decode_positions),
            "verify_rows": len(batch.verify), "draft_tokens": batch.num_drafts,
            "prefill_tokens": batch.chunk_tokens, "prompt_chunks": len(batch.chunks),
            "prefill_pairs": batch.chunk_pairs}) + b"\n")
