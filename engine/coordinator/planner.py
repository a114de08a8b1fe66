"""Adaptive placement: where a prompt is prefilled, and how much prefill a decode step may carry.

A measured cost model decides, under one absolute limit. Each compute unit's step time is fit
online as `fixed + per_decode_row * D + per_prefill_token * P` (one fit per thread count); from it:

- the decode unit's prefill budget per step: the prefill tokens that keep a decode step within the
  ITL target (`--itl-target-ms`; by default twice the decode-only step), or, when the local queue
  would otherwise take more than a few steps to drain, as many as the limit allows (throughput
  first once requests pile up, as colocated serving does). Where the two actors share the CPU's
  cores and no target is given, a local queue goes into one step whole. While rows decode and a
  long prompt is queued, the budget never exceeds `--max-local-prefill-length`, however slow the
  decode step; otherwise it is at most the full `max_prefill_tokens`;
- per request, while rows decode: a prompt whose uncached tokens exceed the max local prefill
  length goes to the prefill actor (NVIDIA Dynamo's conditional disaggregation), unless that
  actor is so far behind that it could not even start on the prompt before the decode unit had
  its first token (Dynamo's max_prefill_queue_size, measured in seconds); a shorter prompt is
  prefilled locally when it fits one step's budget, else where its first token comes sooner
  (local chunks at that budget, or the prefill actor's backlog plus the prompt at its measured
  rate). Prefix-cache hits on either pool lower that side's cost: a conversation's next turn goes
  where its history is.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.actors.step_cost import StepCostModel

BACKLOG_STEPS = 4            # a local queue that needs more steps than this at the ITL budget: throughput mode
MAX_LOCAL_PREFILL_LENGTH = 1000   # NVIDIA Dynamo's default max_local_prefill_length (tokens)
STALL_WINDOW = 500           # decode steps over which stalls are counted
TAIL_FRACTION = 0.01         # stalls in at most this share of decode steps leave the p99 ITL alone
STALL_FACTOR = 2.0           # a decode step longer than this many ITL targets is a stall
WHOLE_PROMPT_TARGETS = 1.5   # on shared cores a step may carry a whole short prompt up to this many targets,
#                              clear of the stall line so that such steps never count as stalls


@dataclass(frozen=True, slots=True)
class LoadState:
    """What a placement decision reads off the two actors."""

    decode_rows: int                 # sequences decoding on the decode unit
    local_queued_tokens: int         # prompt tokens waiting for a local prefill
    remote_backlog_tokens: int       # prompt tokens queued on or being prefilled by the prefill actor
    decode_threads: int
    prefill_threads: int
    long_queued: bool = False        # a local queued prompt is longer than the max local prefill length


@dataclass(frozen=True, slots=True)
class Placement:
    local: bool
    reason: str


@dataclass(slots=True)
class StallCounter:
    """How many of the last STALL_WINDOW decode steps ran past their stall threshold."""

    _stalled: deque[bool] = field(default_factory=lambda: deque(maxlen=STALL_WINDOW))
    stalls: int = 0

    def record(self, stalled: bool) -> None:
        if len(self._stalled) == STALL_WINDOW:
            self.stalls -= self._stalled[0]
        self._stalled.append(stalled)
        self.stalls += stalled

    def room_for(self, more: int) -> bool:
        """Whether `more` stalls keep the window's share of stalls within TAIL_FRACTION."""
        return self.stalls + more <= TAIL_FRACTION * STALL_WINDOW


class PlacementPolicy:
    def __init__(self, decode_cost: StepCostModel, prefill_cost: StepCostModel, max_prefill_tokens: int,
                 itl_target: float | None = None, max_local_prefill_length: int | None = None,
                 min_local_chunk: int = 32, shared_cores: bool = False) -> None:
        self.decode_cost, self.prefill_cost = decode_cost, prefill_cost
        self.shared_cores = shared_cores
        self.stalls = StallCounter()
        self.max_prefill_tokens = max_prefill_tokens
        self.itl_target = itl_target
        self.max_local = min(max_local_prefill_length or MAX_LOCAL_PREFILL_LENGTH, max_prefill_tokens)
        self.min_local_chunk = min(min_local_chunk, self.max_local)

    def step_budget(self, state: LoadState) -> int:
        """Prefill tokens the decode unit's next step may carry."""
        if state.decode_rows == 0:
            return self.max_prefill_tokens
        itl_budget = self._itl_budget(state)
        queued = state.local_queued_tokens
        if itl_budget is None or queued > itl_budget * BACKLOG_STEPS or self.whole_local_queue:
            return self._piled_up_budget(state)
        if itl_budget < queued <= self._one_step_budget(state):
            return queued                                          # the whole queue now, short of a stall
        return itl_budget

    def _target(self, decode_step: float) -> float:
        """The ITL target for a step whose decode-only part takes `decode_step` seconds."""
        return self.itl_target if self.itl_target is not None else 2.0 * decode_step

    def _itl_budget(self, state: LoadState, targets: float = 1.0) -> int | None:
        """Prefill tokens that keep a decode step within `targets` ITL targets (at most the max local
        prefill length); None when nothing decodes or no step costs are measured yet."""
        c = self.decode_cost.coefficients(state.decode_threads) if state.decode_rows else None
        if c is None or c[2] <= 0:
            return None
        decode_step = float(c[0] + c[1] * state.decode_rows)
        tokens = int((targets * self._target(decode_step) - decode_step) / c[2])
        return max(self.min_local_chunk, min(tokens, self.max_local))

    def _piled_up_budget(self, state: LoadState) -> int:
        """A queue taken whole or for throughput: a long prompt's chunks stay within the max local
        prefill length; short prompts alone go in up to `max_prefill_tokens`, as colocated serving
        takes them (with the limit, a burst took twice the steps to admit: commit b4c0716; its figures are
        bench/RESULTS.md, "Serving modes")."""
        return self.max_local if state.long_queued else self.max_prefill_tokens

    @property
    def whole_local_queue(self) -> bool:
        """On shared cores with the default ITL target a local queue goes into the next step whole (a
        long prompt's chunks within the max local prefill length), as colocated serving takes it: there,
        chunking a short prompt delays its first token by a decode step per extra chunk and, measured,
        moves no ITL percentile (measured with commit 3c3e9b3: median TTFT 1.35-1.38x colocated's before it,
        0.92-0.99x after). An explicit `--itl-target-ms` is kept."""
        return self.shared_cores and self.itl_target is None

    def _one_step_budget(self, state: LoadState) -> int | None:
        """The most prefill one step takes for a short local queue: the whole queue (above; a prompt
        up to the max local prefill length fits), or on shared cores up to WHOLE_PROMPT_TARGETS
        targets, clear of a stall; else within the target."""
        if self.whole_local_queue:
            return self.max_local
        return self._itl_budget(state, WHOLE_PROMPT_TARGETS if self.shared_cores else 1.0)

    def place(self, local_tokens: int, remote_tokens: int, state: LoadState) -> Placement:
        """Where to prefill a prompt needing `local_tokens` here or `remote_tokens` on the prefill actor."""
        if state.decode_rows == 0:
            return Placement(True, "nothing decodes: the decode unit prefills at full budget")
        if local_tokens > self.max_local:
            return self._place_long(local_tokens, state)
        budget = self._itl_budget(state)
        if budget is None:
            return Placement(True, "no step costs measured yet")
        one_step = self._one_step_budget(state)
        if local_tokens <= one_step:
            return Placement(True, f"{local_tokens} tokens fit one decode step's budget of {one_step}")
        local, remote = self._local_ttft(local_tokens, budget, state), self._remote_ttft(remote_tokens, state)
        if remote is None or local <= remote:
            return Placement(True, f"first token sooner here ({local:.2f}s vs {_s(remote)} remote)")
        return Placement(False, f"first token sooner on the prefill actor ({remote:.2f}s vs {local:.2f}s here)")

    def record_decode_step(self, threads: int, decode_rows: int, seconds: float, carried_long: bool) -> None:
        """A step of the decode unit that decoded `decode_rows` rows: a stall when it carried a chunk of a
        prompt longer than the max local prefill length (the stalls the long-prompt rule spends) and ran
        past STALL_FACTOR ITL targets (the target is what a step within the ITL budget takes)."""
        decode_only = self.decode_cost.predict(threads, decode_rows, 0)
        if decode_only is not None:
            self.stalls.record(carried_long and seconds > STALL_FACTOR * self._target(decode_only))

    def _place_long(self, local_tokens: int, state: LoadState) -> Placement:
        """Longer than the max local prefill length: remote, unless the prefill actor's backlog alone
        outlasts the whole local prefill at the ITL budget (its queue is long: Dynamo's
        max_prefill_queue_size, in measured seconds instead of a count), or, where the two actors
        share the CPU's cores, unless its chunks would stall so few decode steps that the tail ITL
        does not move: a remote prefill there takes half the cores from every decode step meanwhile."""
        chunks = math.ceil(local_tokens / self.max_local)
        if self.shared_cores and self.stalls.room_for(chunks):
            return Placement(True, f"{local_tokens} tokens, {chunks} stalled steps stay within "
                                   f"{TAIL_FRACTION:.0%} of the last {STALL_WINDOW} ({self.stalls.stalls} so far)")
        budget, wait = self._itl_budget(state), self._remote_ttft(0, state)
        local = None if budget is None else self._local_ttft(local_tokens, budget, state)
        if wait is not None and local is not None and wait > local:
            return Placement(True, f"{local_tokens} tokens, but the prefill actor is {wait:.2f}s behind "
                                   f"(first token here in {local:.2f}s)")
        return Placement(False, f"{local_tokens} tokens exceed the max local prefill length of {self.max_local}")

    def _local_ttft(self, tokens: int, budget: int, state: LoadState) -> float:
        steps = math.ceil((state.local_queued_tokens + tokens) / budget)
        return steps * self.decode_cost.predict(state.decode_threads, state.decode_rows, budget)

    def _remote_ttft(self, tokens: int, state: LoadState) -> float | None:
        """The prefill actor's measured rate; before it has run, the decode unit's (same cores, its threads)."""
        cost = self.prefill_cost if self.prefill_cost.coefficients(state.prefill_threads) is not None \
            else self.decode_cost
        per_token = cost.seconds_per_prefill_token(state.prefill_threads)
        fixed = cost.predict(state.prefill_threads, 0, 0)
        if per_token is None or fixed is None:
            return None
        queued = state.remote_backlog_tokens + tokens
        return queued * per_token + math.ceil(queued / self.max_prefill_tokens) * fixed


def _s(seconds: float | None) -> str:
    return "unmeasured" if seconds is None else f"{seconds:.2f}s"
