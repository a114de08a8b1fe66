"""How the planner's local candidates prefill a queue of waiting prompts: the decode steps of a plan and what
streams wait through.

`chunk_plan` walks fixed chunks step by step (a few steps: chunks of a whole `--max-prefill-tokens` step);
`fitting_plan` predicts chunks that keep a step limit in one step, however many steps they take. `StepsUpTo`
answers, for any stream, what the first n steps of a plan add to its gaps and their longest.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.batch import attention_pairs


@dataclass(frozen=True, slots=True)
class Waiting:
    """A prompt waiting for its first token."""

    tokens: int                      # prompt tokens still to compute (prefix-cache hits excluded)
    waited: float = 0.0              # seconds since it arrived
    length: int = 0                  # its prompt's tokens, cached ones included (0: `tokens`)

    @property
    def served(self) -> int:
        return self.length or self.tokens

    @property
    def start(self) -> int:
        """Its prompt's tokens already computed (cached or prefilled): where its next chunk starts."""
        return self.served - self.tokens


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """A local queue's prefill: its decode steps in runs of (how many, seconds each), the steps until each
    prompt's last token, and the first step's chunk (the step budget a decision hands the runner)."""

    runs: tuple[tuple[int, float], ...]
    finished: tuple[int, ...]
    chunk: int

    @property
    def steps(self) -> int:
        return sum(count for count, _ in self.runs)

    @property
    def longest(self) -> float:
        return max(seconds for count, seconds in self.runs if count)

    def seconds_until_done(self) -> float:
        return sum(count * seconds for count, seconds in self.runs)

    def then(self, later: PrefillPlan) -> PrefillPlan:
        """This plan's steps, then `later`'s (whose prompts queue behind these)."""
        return PrefillPlan(self.runs + later.runs, self.finished + tuple(self.steps + f for f in later.finished),
                           self.chunk)

    def seconds_until(self, steps: int) -> float:
        """The first `steps` steps' seconds."""
        total = 0.0
        for count, seconds in self.runs:
            taken = min(count, steps)
            total, steps = total + taken * seconds, steps - taken
        return total


class StepsUpTo:
    """Over an action's steps ((how many, seconds each), in order): the seconds the first n add past decoding
    alone, and the longest of them, for any n (each stream waits for as many as it has tokens left)."""

    def __init__(self, steps: Sequence[tuple[int, float]], alone: float) -> None:
        self._runs = [(count, seconds) for count, seconds in steps if count > 0]
        self._ends = list(itertools.accumulate((count for count, _ in self._runs), initial=0))
        self._added = list(itertools.accumulate((count * max(0.0, seconds - alone) for count, seconds in self._runs),
                                                initial=0.0))
        self._longest = list(itertools.accumulate((seconds for _, seconds in self._runs), max, initial=0.0))
        self._alone = alone

    def __call__(self, n: int) -> tuple[float, float]:
        full = bisect.bisect_right(self._ends, n) - 1           # runs wholly within the first n steps
        added, longest = self._added[full], self._longest[full]
        if full < len(self._runs) and n > self._ends[full]:     # part of the next run
            _, seconds = self._runs[full]
            added += (n - self._ends[full]) * max(0.0, seconds - self._alone)
            longest = max(longest, seconds)
        return added, longest


def fitting_plan(queue: Sequence[Waiting], rows: int, context: int, decode: StepCostModel, threads: int | None,
                 limit: float, most: int) -> PrefillPlan | None:
    """Chunks whose steps of `rows` rows (reading `context` KV tokens) keep `limit` seconds, each sized at its
    step's offset into its prompt, up to `most` tokens. A queue's prompt work (tokens and attention pairs) is the
    same however it is chunked and each step carries up to the room the limit leaves it, so the queue takes
    ceil(work / room) steps of the limit's length, the last shorter (whole tokens leave under a token's work a
    step unused). One prediction however many steps: walking a plan of tiny chunks step by step made a decision
    slow. None without rows to keep it for, or where not one token fits a step (at the queue's deepest
    offset)."""
    if not rows or not decode.seconds_per_prefill_token(threads):
        return None
    room = decode.prompt_room(threads, limit, rows, context)
    deepest = max(w.start + max(1, w.tokens) for w in queue)            # its last token's attention pairs
    if room <= 0 or decode.prompt_work(threads, 1, deepest) > room:
        return None
    work, finished = 0.0, []
    for waiting in queue:
        tokens = max(1, waiting.tokens)
        work += decode.prompt_work(threads, tokens, attention_pairs(waiting.start, tokens))
        finished.append(max(1, math.ceil(work / room * (1 - 1e-9))))
    steps = finished[-1]
    last = limit - room + work - (steps - 1) * room
    chunk = decode.chunk_within(threads, limit, rows, context, queue[0].start, most)
    return PrefillPlan(((steps - 1, limit), (1, last)), tuple(finished), chunk)


def chunk_plan(queue: Sequence[Waiting], chunk: int, rows: int, context: int, decode: StepCostModel,
               threads: int | None) -> PrefillPlan:
    """The queue prefilled in order, `chunk` tokens a decode step of `rows` rows reading `context` KV tokens,
    each step priced at its offsets."""
    left = [(w.start, max(1, w.tokens)) for w in queue]     # (offset, tokens to compute) of each prompt
    runs, finished, head = [], [], 0
    while head < len(left):
        budget, tokens, pairs = chunk, 0, 0
        while budget and head < len(left):
            start, todo = left[head]
            taken = min(todo, budget)
            tokens, pairs, budget = tokens + taken, pairs + attention_pairs(start, taken), budget - taken
            if taken == todo:
                head += 1
                finished.append(len(runs) + 1)
            else:
                left[head] = (start + taken, todo - taken)
        runs.append((1, decode.predict(threads, rows, tokens, context, pairs=pairs)))
    return PrefillPlan(tuple(runs), tuple(finished), chunk)
