"""Start-up profile: a few synthetic steps on a unit, timed on the unit itself, before any request.

The steps go through the unit's own compute (its thread and cores, or its worker process) at the
thread counts given, and feed a step cost model the SLOs not set are derived from
(`pdserve.engine.coordinator.slo`). A first, untimed step pays the one-time costs (allocations, lazily
built kernels).
"""
from __future__ import annotations

import logging
import random
import statistics
from dataclasses import dataclass, field, replace

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.batch import attention_pairs
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.coordinator.profile_store import ProfileStore, drifted
from pdserve.engine.coordinator.slo import MeasuredUnits, prefill_step_tokens, profile_context, typical_prompt_tokens
from pdserve.engine.units.spec import Layout, UnitSpec
from pdserve.engine.units.units import Units
from pdserve.engine.worker.compute import Compute
from pdserve.engine.worker.memory import return_freed_memory
from pdserve.engine.worker.startup.warmup import StepShape, slot_count, synthetic_step
from pdserve.engine.worker.step import StepInput, StepWork


logger = logging.getLogger(__name__)

PROBES = 3                   # runs of each probe step a kept profile is checked with (their median)
MESSAGE_TOKENS = 16384       # prompt tokens one profile step's rows carry at most: a step's message to a worker
#                              process (~4.5 bytes a token) stays within a socket buffer
DRIFT_PROBE_ROWS = 64        # the largest decode batch a kept profile is checked with (see `_probes`)


@dataclass(frozen=True, slots=True)
class UnitProfile:
    """What to run on one unit: which phases it steps, and with how many threads (None: its own); `timed`:
    each step's seconds by (shape, threads), once run. Units of one `compute_kind` (what runs them, device
    and cores) take the same time for a step: what one ran, the other takes from it."""

    unit: Compute
    cost: StepCostModel
    decodes: bool
    prefills: bool
    compute_kind: tuple
    thread_counts: tuple[int | None, ...] = (None,)
    timed: dict[tuple[StepShape, int | None], float] = field(default_factory=dict)

    def own_timing(self, shape: StepShape) -> float | None:
        """Seconds of `shape` as profiled on the unit's own threads (the first count), or None: not run."""
        return self.timed.get((shape, self.thread_counts[0]))


def profile_shapes(sched: SchedulerConfig, max_model_len: int, decodes: bool, prefills: bool) -> list[StepShape]:
    """Decode-only steps of one row and of a full batch at a short context, one row at a long context and the
    full batch at as long a one as MESSAGE_TOKENS allows; prefill steps of one token, a typical prompt and half a
    prefill step, and the last quarter of a full step's prompt after the rest (a chunk's attention over its
    prompt's earlier chunks): the points that separate the cost model's coefficients. A full prefill step and a
    full batch at the long context are predicted from them, not run: the full step is the profile's longest by
    far (seconds on one core), and each step's message stays small (its rows' tokens travel to a worker)."""
    rows, context = sched.max_num_seqs, profile_context(sched, max_model_len)
    shapes = []
    if decodes:
        shapes += [StepShape("decode", 1, 1, context=1), StepShape("decode", rows, 1, context=1),
                   one_row_shape(sched, max_model_len),
                   StepShape("decode", rows, 1, context=max(1, min(context, MESSAGE_TOKENS // rows)))]
    if prefills:
        tokens = prefill_step_tokens(sched, max_model_len)
        shapes += [StepShape("prefill", 1, n) for n in dict.fromkeys((1, typical_prompt_tokens(sched, max_model_len),
                                                                      max(1, tokens // 2)))]
        if tokens >= 4:
            shapes.append(StepShape("prefill", 1, tokens // 4, context=tokens - tokens // 4))
    return shapes


def one_row_shape(sched: SchedulerConfig, max_model_len: int) -> StepShape:
    """The one-row decode step at the SLO's context (`slo.profile_context`), whose timing the ITL SLO takes."""
    return StepShape("decode", 1, 1, context=profile_context(sched, max_model_len))


def typical_prompt_shape(sched: SchedulerConfig, max_model_len: int) -> StepShape:
    """A typical prompt's prefill step (`slo.typical_prompt_tokens`), whose timing the TTFT SLO takes."""
    return StepShape("prefill", 1, typical_prompt_tokens(sched, max_model_len))


async def profile_unit(profile: UnitProfile, sched: SchedulerConfig, max_model_len: int, vocab_size: int,
                       alike: dict, seed: int = 0) -> list[list]:
    """Run and observe the profile steps of one unit; returns what it observed (`observe`'s arguments per step).
    `alike`: what earlier units observed, by (compute kind, shape, threads); a step found there is not run again."""
    rng, observed = random.Random(seed), []
    shapes = profile_shapes(sched, max_model_len, profile.decodes, profile.prefills)
    for threads in profile.thread_counts:
        to_run = [shape for shape in shapes if (profile.compute_kind, shape, threads) not in alike]
        if to_run:
            await run_shape(profile.unit, to_run[0], threads, vocab_size, rng)     # untimed: one-time costs
        for shape in shapes:
            key = (profile.compute_kind, shape, threads)
            if key not in alike:
                outcome = await run_shape(profile.unit, shape, threads, vocab_size, rng)
                alike[key] = [shape.kind, shape.num_seqs, shape.new_tokens, shape.context, threads, outcome.threads,
                              outcome.seconds]
            observed.append(alike[key])
            observe(profile, *observed[-1])
    return observed


def observe(profile: UnitProfile, kind: str, num_seqs: int, new_tokens: int, context: int, threads: int | None,
            ran_threads: int, seconds: float) -> None:
    """One profile step of `profile`'s unit, timed (now, or at an earlier start): its cost model learns it."""
    shape = StepShape(kind, num_seqs, new_tokens, context)
    profile.timed[shape, threads] = seconds
    decoding = kind == "decode"
    profile.cost.observe(ran_threads, num_seqs if decoding else 0, 0 if decoding else num_seqs * new_tokens,
                         seconds, context=num_seqs * context if decoding else 0,
                         pairs=0 if decoding else num_seqs * attention_pairs(context, new_tokens))


async def run_shape(unit: Compute, shape: StepShape, threads: int | None, vocab_size: int, rng: random.Random):
    """One synthetic step of `shape` on `unit`, its rows given back after; its StepOutcome."""
    step = synthetic_step(shape, vocab_size, unit.block_size, unit.num_blocks, rng, slot_count(unit.state_slots))
    outcome = await unit.submit(StepWork(step, threads=threads))
    await unit.submit(StepWork(StepInput(freed_rows=tuple(row.row for row in step.new_rows))))
    return outcome


async def measure_units(sched: SchedulerConfig, layout: Layout, units: Units, vocab_size: int,
                        decode_units_prefill: bool, store: ProfileStore | None = None) -> MeasuredUnits | None:
    """Profile the first unit that decodes and the first prefill unit; None with `startup_profile` off (both SLOs
    are then set). Each runs on its own threads and, where cores are lent, on both units' threads too; a unit that
    decodes is profiled prefilling too where it does (its own steps' prefill priced from decode steps alone is
    far off). The units' cost models (routing, the planner) start from it and learn from serving steps on.
    With a `store`, a profile kept from an earlier start is replayed instead, unless a probe step has drifted."""
    if not sched.startup_profile:
        return None
    share = layout.lending
    decode_unit = units.decoding[0]
    prefill_unit = units.prefills[0] if units.prefills else None
    decode = UnitProfile(decode_unit, StepCostModel(), True, decode_units_prefill or prefill_unit is None,
                         compute_kind(decode_unit, layout.decoding[0]), share and (share.decode_own,) or (None,))
    prefill = decode if prefill_unit is None else UnitProfile(
        prefill_unit, StepCostModel(), False, True, compute_kind(prefill_unit, layout.prefill[0]),
        share and (share.prefill_own,) or (None,))
    profiles = [decode] if prefill is decode else [decode, prefill]
    if share is not None:            # lent cores: each unit as it steps on both units' threads
        profiles += [replace(decode, prefills=True, thread_counts=(share.total,)),
                     replace(prefill, thread_counts=(share.total,))]
    kept = store.load() if store is not None and not sched.refresh_profile else None
    if kept is not None and len(kept) == len(profiles) and not await _drifted(profiles, kept, vocab_size):
        for profile, observed in zip(profiles, kept):
            for entry in observed:
                observe(profile, *entry)
        logger.info("start-up profile: kept from an earlier start (%s)", store.path)
    else:
        alike: dict = {}
        kept = [await profile_unit(profile, sched, layout.max_model_len, vocab_size, alike) for profile in profiles]
        if store is not None:
            store.save(kept)
    return_freed_memory()
    return MeasuredUnits(decode.cost, share and share.decode_own, prefill.cost, share and share.prefill_own,
                         decode.own_timing(one_row_shape(sched, layout.max_model_len)),
                         prefill.own_timing(typical_prompt_shape(sched, layout.max_model_len)))


def compute_kind(unit: Compute, spec: UnitSpec) -> tuple:
    """What a step's time on `unit` depends on besides the step: what runs it, its device and its cores."""
    return unit.kind, str(spec.device), len(spec.cores)


async def _drifted(profiles: list[UnitProfile], kept: list[list[list]], vocab_size: int) -> bool:
    """Run kept steps again (each the median of three, after one untimed): the first, and the largest decode batch
    at the most threads (a profile taken while other work ran is slowest where threads contend, and lending is
    decided there); whether one now takes far longer or shorter than it did (the machine or its load changed:
    the profile is measured again)."""
    for index, entry in _probes(kept):
        kind, num_seqs, new_tokens, context, threads, _, seconds = entry
        shape, rng = StepShape(kind, num_seqs, new_tokens, context), random.Random(1)
        unit = profiles[index].unit
        runs = [(await run_shape(unit, shape, threads, vocab_size, rng)).seconds for _ in range(PROBES + 1)]
        now = statistics.median(runs[1:])
        if drifted(seconds, now):
            logger.info("start-up profile: measured again (a probe step took %.1f ms, %.1f ms when kept)",
                        now * 1e3, seconds * 1e3)
            return True
    return False


def _probes(kept: list[list[list]]) -> list[tuple[int, list]]:
    """(profile index, kept entry) of the steps `_drifted` runs again: the first, and the heaviest decode step of
    at most `DRIFT_PROBE_ROWS` rows (a full batch's logits and activations were most of a lightly loaded
    server's peak memory, for a check that a smaller contended step makes as well)."""
    first = (0, kept[0][0])
    decodes = [(i, entry) for i, observed in enumerate(kept) for entry in observed
               if entry[0] == "decode" and entry[1] <= DRIFT_PROBE_ROWS]
    if not decodes:
        return [first]
    heaviest = max(decodes, key=lambda item: (item[1][4] or 0, item[1][1], -item[1][3]))
    return [first] if heaviest[1] == first[1] else [first, heaviest]
