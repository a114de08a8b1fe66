"""KV pool sizing on CUDA after a profile run (as vLLM does): what the device needs besides the pool is
measured before the pool is allocated.

Order: the free memory of each device is read before anything is loaded on it; the weights are
loaded; each runner's largest steps (the prefill budget, the decode batch with the sampler's
full-sort fallback, a slice of prompt logprobs) run on a scratch pool while the allocator's peak is
tracked; the decode CUDA graphs are captured once on the scratch pool to measure their memory pool. A fractional
`--kv-cache-memory f` then gives the pool `f x free-at-start - (what is in use now) - activations -
graphs`; an absolute one must fit beside them. Either way the pool must hold at least one full
prefill step, or start-up stops with a message that says what took the memory.
"""
from __future__ import annotations

import gc
import logging
import random
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.worker.cuda_graph import DecodeGraphs
from pdserve.engine.worker.device import on_device, side_stream
from pdserve.engine.worker.memory import DEFAULT_KV_BUDGET, kv_block_bytes, kv_layout, parse_memory
from pdserve.engine.worker.model_runner import ModelRunner
from pdserve.engine.worker.prompt_logprobs import SLICE_POSITIONS, score_positions
from pdserve.engine.worker.startup.warmup import StepShape, run_synthetic, slot_count, synthetic_step
from pdserve.engine.worker.state_pool import slot_blocks

logger = logging.getLogger(__name__)
GiB = 2**30
WORST_CASE = SamplingParams(temperature=0.7, top_p=0.999, min_p=0.01, presence_penalty=0.5,
                            repetition_penalty=1.1, logprobs=SamplingParams.MAX_LOGPROBS)


class InsufficientMemory(ValueError):
    """The model, its working memory and a minimum KV pool do not fit the device."""


class DeviceMemory(Protocol):
    """The memory readings sizing needs (torch.cuda's for one device; tests fake them)."""

    def free(self) -> int: ...
    def total(self) -> int: ...
    def allocated(self) -> int: ...
    def peak_allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def release_cached(self) -> None: ...


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        gc.collect()
        with on_device(self.device):
            torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class Demand:
    """One runner's claim on a device: its share of the KV budget and its largest steps."""

    model: CausalLM
    share: float
    max_useful_blocks: int
    steps: tuple[StepShape, ...]   # profiled one after another; the peak counts
    sampled_rows: int              # most rows it samples in one step
    graph_batch: int = 0           # > 0: it captures decode graphs up to this batch


@dataclass(frozen=True, slots=True)
class Reserve:
    activations: int
    graphs: int

    @property
    def total(self) -> int:
        return self.activations + self.graphs


def weights_bytes(config: ModelConfig, dtype: torch.dtype, max_positions: int) -> int:
    """Bytes of the model's parameters and buffers in `dtype`, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = CausalLM(config, max_positions).to(dtype)
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """A CUDA device's KV budget: `fraction` of the memory free at start-up (of the device's `total` when
    given: --gpu-memory-utilization), or `absolute` bytes."""

    device: torch.device
    free_at_start: int
    absolute: int | None
    fraction: float | None
    total: int | None = None

    @classmethod
    def at_start(cls, device: torch.device, spec: str | None, memory: DeviceMemory,
                 utilization: float | None = None) -> DeviceBudget:
        """InsufficientMemory when `utilization` of the device is more than is free (as vLLM refuses to start)."""
        if utilization is not None:
            budget = cls(device, memory.free(), None, utilization, memory.total())
            if budget.limit() > budget.free_at_start:
                raise InsufficientMemory(f"{device}: --gpu-memory-utilization asks for {budget.describe()}, but "
                                         f"only {budget.free_at_start / GiB:.2f} GiB are free; lower it")
            return budget
        absolute, fraction = parse_memory(spec or DEFAULT_KV_BUDGET["cuda"])
        return cls(device, memory.free(), absolute, fraction)

    def limit(self) -> int:
        """Bytes pdserve may take on the device in all: weights, working memory and KV."""
        if self.fraction is None:
            return self.free_at_start
        return int(self.fraction * (self.total or self.free_at_start))

    def describe(self) -> str:
        if self.fraction is None:
            return f"the {self.free_at_start / GiB:.2f} GiB free at start-up"
        if self.total is not None:
            return f"{self.fraction:g} of the device's {self.total / GiB:.2f} GiB"
        return f"{self.fraction:g} of the {self.free_at_start / GiB:.2f} GiB free at start-up"

    def check_weights(self, weights: int) -> None:
        """InsufficientMemory when the weights alone exceed the limit (checked before loading them)."""
        if weights > self.limit():
            raise InsufficientMemory(f"{self.device}: the weights need {weights / GiB:.2f} GiB, more than "
                                     f"{self.describe()}")

    def kv_bytes(self, free_now: int, reserve: Reserve) -> int:
        """KV bytes: the absolute budget, or the limit less what is in use since start-up and `reserve`."""
        if self.fraction is None:
            return self.absolute
        return self.limit() - (self.free_at_start - free_now) - reserve.total


def measure_reserve(demand: Demand, block_size: int, max_blocks_per_seq: int, memory: DeviceMemory) -> Reserve:
    """Peak working memory of the demand's steps, and the memory of its decode graphs (0 without)."""
    model = demand.model
    device = model.embed_tokens.weight.device
    scratch_blocks = max(_blocks_touched(step, block_size) for step in demand.steps)
    rows = max(step.num_seqs for step in demand.steps)                  # a model with recurrent layers: their states
    dtype = model.embed_tokens.weight.dtype
    state_blocks = rows * slot_blocks(model.config, kv_layout(model.config, block_size), dtype)
    with on_device(device), side_stream(device):
        runner = ModelRunner(model, scratch_blocks + state_blocks, block_size, frozenset(), state_slots=rows)
        baseline = memory.allocated()
        memory.reset_peak()
        for step in demand.steps:
            run_synthetic(runner, synthetic_step(step, model.config.vocab_size, block_size, scratch_blocks,
                                                 random.Random(0), slot_count(runner.state_slots)))
        _sample_the_worst_case(runner, demand.sampled_rows)
        _score_the_worst_case(runner)
        activations = max(0, memory.peak_allocated() - baseline)
        graphs = _graph_bytes(runner, demand.graph_batch, max_blocks_per_seq, memory) if demand.graph_batch else 0
        del runner
    memory.release_cached()
    return Reserve(activations, graphs)


def _sample_the_worst_case(runner: ModelRunner, rows: int) -> None:
    """The sampler's largest workspace: nearly flat logits send every row to the full-sort top-p path."""
    vocab = runner.model.config.vocab_size
    logits = torch.randn(rows, vocab, device=runner.device).mul_(1e-3)      # [rows, V] fp32
    seqs = [Sequence(Request(f"profile-{i}", (i % vocab,), WORST_CASE), [i % vocab]) for i in range(rows)]
    runner.sampler(logits, seqs)


def _score_the_worst_case(runner: ModelRunner) -> None:
    """Prompt logprobs' largest workspace: a full slice of positions through the LM head, the most alternatives."""
    model, device = runner.model, runner.device
    hidden = torch.randn(SLICE_POSITIONS, model.config.hidden_size, device=device, dtype=runner.dtype)
    positions = torch.arange(SLICE_POSITIONS, device=device)
    targets = torch.zeros(SLICE_POSITIONS, dtype=torch.int64, device=device)
    score_positions(model, hidden, positions, targets, min(SamplingParams.MAX_LOGPROBS, model.config.vocab_size))


def _graph_bytes(runner: ModelRunner, max_batch: int, max_blocks_per_seq: int, memory: DeviceMemory) -> int:
    memory.release_cached()
    before = memory.reserved()
    graphs = DecodeGraphs(runner.model, runner.kv_pool, max_batch, max_blocks_per_seq)
    grown = memory.reserved() - before
    del graphs
    return max(0, grown)


def _blocks_touched(step: StepShape, block_size: int) -> int:
    per_seq = -(-(step.context + step.new_tokens + 1) // block_size)
    return per_seq * step.num_seqs


def kv_blocks(budget: DeviceBudget, demands: list[Demand], config: ModelConfig, block_size: int,
              dtype: torch.dtype, max_blocks_per_seq: int, min_tokens: int, memory: DeviceMemory,
              split: bool = False) -> list[int]:
    """Blocks for each demand's pool on `budget.device`, measured as the module docstring says.

    Raises InsufficientMemory when a pool would hold fewer than `min_tokens` tokens."""
    reserves = [measure_reserve(d, block_size, max_blocks_per_seq, memory) for d in demands]
    reserve = Reserve(sum(r.activations for r in reserves), sum(r.graphs for r in reserves))
    free_now = memory.free()
    kv = budget.kv_bytes(free_now, reserve)
    block = kv_block_bytes(config, block_size, dtype, split)
    min_blocks = -(-min_tokens // block_size)
    blocks = [min(int(max(kv, 0) * d.share) // block, d.max_useful_blocks) for d in demands]
    fits = kv + reserve.total <= free_now
    if not fits or any(b < min(min_blocks, d.max_useful_blocks) for b, d in zip(blocks, demands)):
        raise InsufficientMemory(_shortfall(budget, free_now, reserve, kv, min_blocks * block, fits))
    logger.info("%s: KV pools of %s blocks (%.2f GiB) beside %.2f GiB in use, %.2f GiB of activations and "
                "%.2f GiB of CUDA graphs", budget.device, "+".join(map(str, blocks)), sum(blocks) * block / GiB,
                (budget.free_at_start - free_now) / GiB, reserve.activations / GiB, reserve.graphs / GiB)
    return blocks


def _shortfall(budget: DeviceBudget, free_now: int, reserve: Reserve, kv: int, minimum: int, fits: bool) -> str:
    in_use = budget.free_at_start - free_now
    what = (f"{budget.device}: weights and CUDA context {in_use / GiB:.2f} GiB, activations "
            f"{reserve.activations / GiB:.2f} GiB, CUDA graphs {reserve.graphs / GiB:.2f} GiB")
    if not fits:
        return (f"{what} leave {(free_now - reserve.total) / GiB:.2f} GiB free, less than the "
                f"--kv-cache-memory of {kv / GiB:.2f} GiB; lower it, --max-prefill-tokens or --max-num-seqs")
    return (f"{what} leave {max(kv, 0) / GiB:.2f} GiB of {budget.describe()} for the KV cache, less "
            f"than one prefill step needs ({minimum / GiB:.3f} GiB); raise --kv-cache-memory, lower "
            f"--max-prefill-tokens or --max-num-seqs, use --no-cuda-graph, or a device with more memory")
