"""Run every kernel variant serving can hit before the server reports ready.

A Triton kernel compiles on its first launch with each new specialization (seconds that stall every
stream); the kernels mark their runtime sizes `do_not_specialize`, so what is left to specialize on
is the shape class of a step. `warmup_shapes` lists those classes from what the schedulers can build
(decode at every batch bucket, prefill from one token up to the prefill budget, a chunk after a
prefix, mixed steps in colocated mode) and `warm_up` runs each one through the runner, on its own
device, before the actor starts.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from pdserve import kernels
from pdserve.engine.core.state_slots import StateSlots
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.model.layers import Linear
from pdserve.engine.model.gemma4_moe import Gemma4MoE
from pdserve.engine.model.moe import SparseMoE
from pdserve.engine.model.quant import QuantizedLinear
from pdserve.engine.model.quant_probe import probe_bytes
from pdserve.engine.worker.cuda_graph import batch_buckets
from pdserve.engine.worker.device import on_device, side_stream
from pdserve.engine.worker.model_runner import ModelRunner
from pdserve.engine.worker.step import ChunkInput, NewRow, StepInput
from pdserve.kernels.native_linear import row_buckets, warm_prefer_native

ROLES = ("prefill", "decode", "colocated")
ONE_CALL_TIMED_ROWS = 8      # decode batches whose whole step is timed both ways at load; above, the kernels' race
ONE_CALL_TIMED_RUNS = 2
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
# NOTE: a sampled step alternates these per row, so every sampler branch runs: penalties, top-k, top-p, min-p,
# logprobs, greedy rows among sampled ones
SAMPLED = (SamplingParams(max_tokens=1, temperature=0.7, top_k=40, top_p=0.9, presence_penalty=0.5, logprobs=5),
           SamplingParams(max_tokens=1, temperature=1.0, top_p=0.999, min_p=0.01, repetition_penalty=1.1),
           SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))


@dataclass(frozen=True, slots=True)
class StepShape:
    """One class of step: `num_seqs` sequences, each computing `new_tokens` after `context` cached ones."""

    kind: str              # "prefill", "decode" or "mixed" (decode rows plus one prefill chunk)
    num_seqs: int
    new_tokens: int
    context: int = 0
    sampled: bool = False  # rows take SAMPLED's parameters in turn instead of greedy ones


def warmup_shapes(role: str, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int) -> list[StepShape]:
    """The step classes an actor of `role` can be handed, smallest first."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    shapes = []
    if role != "decode":
        shapes += _prefill_shapes(max_num_seqs, min(max_prefill_tokens, max_model_len - 1))
    if role != "prefill":
        shapes += [StepShape("decode", n, 1, context=1) for n in batch_buckets(max_num_seqs)]
        shapes.append(StepShape("decode", max_num_seqs, 1, context=1, sampled=True))
    if role == "colocated":
        budget = min(max_prefill_tokens, max_model_len - 1)
        decode_rows = min(max_num_seqs, budget) - 1
        shapes.append(StepShape("mixed", decode_rows + 1, max(1, budget - decode_rows), context=1))
    return shapes


def _prefill_shapes(max_num_seqs: int, budget: int) -> list[StepShape]:
    sizes = sorted({1 << k for k in range(budget.bit_length()) if 1 << k <= budget} | {budget})
    shapes = [StepShape("prefill", 1, size) for size in sizes]
    many = min(max_num_seqs, budget)
    shapes.append(StepShape("prefill", many, budget // many, sampled=True))
    if budget >= 2:
        shapes.append(StepShape("prefill", 1, budget // 2, context=budget - budget // 2))   # a later chunk
    return shapes


def warm_up_for_serving(runner: ModelRunner, role: str, sched: SchedulerConfig, max_model_len: int,
                        thread_counts: tuple[int, ...] = ()) -> int:
    """Warm a CUDA runner up for every step class of `role` (see the module docstring); on CPU, decide the
    native linear's batches for every thread count a step may run with (default: the current one).
    Returns the steps (CUDA) or decisions (CPU) made."""
    if runner.device.type == "cpu":
        counts = thread_counts or (torch.get_num_threads(),)
        return warm_cpu_linears(runner.model, counts) + time_one_call_steps(runner, counts)
    return warm_up(runner, warmup_shapes(role, sched.max_num_seqs, sched.max_prefill_tokens, max_model_len))


def warm_cpu_linears(model: torch.nn.Module, thread_counts: tuple[int, ...]) -> int:
    """`pdserve.kernels.native_linear.warm_prefer_native` over every weight `pdserve.kernels.linear` can be handed: the
    projections (a quantized one's dense weight serves its larger batches) and a tied head's embedding, streaming
    as many bytes as the quantization probe does (twice the CPU's largest cache); an expert layer's router and
    each expert's matrices too."""
    if not kernels.use_native(model.embed_tokens.weight):
        return 0
    weights = [m.weight for m in model.modules() if isinstance(m, (Linear, QuantizedLinear))]
    weights += [w for m in model.modules() if isinstance(m, (SparseMoE, Gemma4MoE)) for w in m.linear_weights()]
    if model.lm_head is None:
        weights.append(model.embed_tokens.weight)
    return warm_prefer_native(weights, thread_counts, probe_bytes())


def time_one_call_steps(runner: ModelRunner, thread_counts: tuple[int, ...], seed: int = 0) -> int:
    """For each row bucket up to ONE_CALL_TIMED_ROWS and each thread count, time a decode step through the
    one-call native step and through the per-op path and keep the faster (`DecodeLayers.decide`); returns the
    decisions made. Per kernel BLAS can beat the native linear at one row while the per-op path's Python per
    op makes the step slower than the one-call step (bench/RESULTS.md, "One-call decode step"): only the whole
    step answers which is faster."""
    model = runner.model
    if (model.backend or kernels.choose_backend(model.embed_tokens.weight)) is not kernels.Backend.NATIVE:
        return 0
    layers = model.one_call_layers()
    if layers is None or layers.dtype != model.embed_tokens.weight.dtype:
        return 0
    rng, vocab, previous, decided = random.Random(seed), model.config.vocab_size, torch.get_num_threads(), 0
    try:
        for threads in sorted(set(thread_counts)):
            torch.set_num_threads(threads)
            for rows in (b for b in row_buckets() if b <= ONE_CALL_TIMED_ROWS):
                step = synthetic_step(StepShape("decode", rows, 1, context=runner.block_size), vocab,
                                      runner.block_size, runner.num_blocks, rng)
                seconds = {}
                for one_call in (True, False):
                    layers.decide(rows, threads, one_call)
                    run_synthetic(runner, step)                                   # warm-up
                    seconds[one_call] = min(_timed_synthetic(runner, step) for _ in range(ONE_CALL_TIMED_RUNS))
                layers.decide(rows, threads, seconds[True] <= seconds[False])
                decided += 1
    finally:
        torch.set_num_threads(previous)
    return decided


def _timed_synthetic(runner: ModelRunner, step: StepInput) -> float:
    started = time.perf_counter()
    run_synthetic(runner, step)
    return time.perf_counter() - started


def warm_up(runner: ModelRunner, shapes: list[StepShape], seed: int = 0) -> int:
    """Run one step of every shape on the runner's device; returns the number of steps run.

    The steps write into the (still unused) KV pool; the runner's timing counters are reset after."""
    rng = random.Random(seed)
    with on_device(runner.device), side_stream(runner.device):
        for shape in shapes:
            run_synthetic(runner, synthetic_step(shape, runner.model.config.vocab_size, runner.block_size,
                                                 runner.num_blocks, rng, slot_count(runner.state_slots)))
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    runner.forward_seconds = 0.0
    return len(shapes)


def synthetic_step(shape: StepShape, vocab_size: int, block_size: int, num_blocks: int,
                   rng: random.Random, state_slots: int = 0) -> StepInput:
    """A step of `shape` over random tokens in rows 0 .. n - 1; block ids (and, for a model with recurrent layers,
    its `state_slots` slots) wrap around a pool too small to hold it."""
    new_rows, decode_rows, positions, chunks, next_block = [], [], [], [], 0
    for row, (decode_row, context, new_tokens) in enumerate(_rows(shape)):
        params = SAMPLED[row % len(SAMPLED)] if shape.sampled else GREEDY
        known = context + (1 if decode_row else new_tokens)          # a decode row: its prompt and one output
        tokens = tuple(rng.randrange(vocab_size) for _ in range(known))
        needed = -(-(context + new_tokens) // block_size)
        blocks = tuple((next_block + b) % num_blocks for b in range(needed))
        next_block += needed
        new_rows.append(NewRow(row, tokens, context if decode_row else known, blocks, params,
                               row % state_slots if state_slots else -1))
        if decode_row:
            decode_rows.append(row)
            positions.append(context)
        else:
            chunks.append(ChunkInput(row, context, new_tokens, sample=True))
    return StepInput(new_rows=tuple(new_rows), decode_rows=tuple(decode_rows), decode_positions=tuple(positions),
                     chunks=tuple(chunks))


def slot_count(slots: StateSlots | None) -> int:
    return 0 if slots is None else slots.count


def run_synthetic(runner: ModelRunner, step: StepInput) -> None:
    """Run a synthetic step, then give its rows back (serving hands the same row numbers out again)."""
    runner.execute(step)
    runner.apply(StepInput(freed_rows=tuple(new.row for new in step.new_rows)))


def _rows(shape: StepShape) -> list[tuple[bool, int, int]]:
    """(decode row, cached tokens, new tokens) per sequence; a mixed step packs decode rows first."""
    if shape.kind == "mixed":
        return [(True, shape.context, 1)] * (shape.num_seqs - 1) + [(False, 0, shape.new_tokens)]
    return [(shape.kind == "decode", shape.context, shape.new_tokens)] * shape.num_seqs
