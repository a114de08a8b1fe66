"""Turn an EngineConfig into loaded models, sized KV pools, compute units, and actors wired over them."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import kernels
from engine.actors.adaptive import AdaptiveDecodeActor, CoreShare, LendingPrefillActor
from engine.actors.base import Actor, Emit
from engine.actors.colocated import ColocatedActor
from engine.actors.decode import DecodeActor
from engine.actors.placement import PlacementPolicy, StepCostModel
from engine.actors.prefill import PrefillActor
from engine.config import DTYPES, EngineConfig, ModelConfig
from engine.core.block_manager import blocks_for
from engine.model.quant import gguf_source, quantize_model
from engine.model.resolve import resolve_model
from engine.transfer.select import select_transfer
from engine.worker.compute import Compute, ThreadCompute
from engine.worker.startup.cpu_kernels import prepare_cpu_kernels
from engine.worker.startup.defaults import Choice, choose_devices, choose_dtype, visible_gpus
from engine.worker.device import with_index
from engine.worker.model_runner import ModelRunner, load_model
from engine.worker.startup.sizing import PoolSizer
from engine.worker.step_runner import StepRunner
from engine.worker.startup.warmup import warm_up_for_serving

logger = logging.getLogger(__name__)

PREFILL_SHARE_OF_SHARED_DEVICE = 0.25
MODES = ("adaptive", "disaggregated", "colocated")
WORKERS = ("thread", "process")


@dataclass(frozen=True, slots=True)
class Plan:
    """Decisions made once at start-up."""

    mode: str
    prefill_device: torch.device
    decode_device: torch.device
    dtype: torch.dtype
    max_model_len: int
    prefill_cores: tuple[int, ...]
    decode_cores: tuple[int, ...]


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory a --model value names (see `engine.model.resolve`)."""
    return resolve_model(model).path


def make_plan(config: EngineConfig, model_config: ModelConfig) -> Plan:
    """Devices, mode, dtype and cores; an option not given is chosen from the machine (and logged)."""
    prefill, decode = _devices(config)
    for device in (prefill, decode):
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
    mode = config.mode or _default_mode(prefill, decode)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if config.workers not in WORKERS:
        raise ValueError(f"workers must be one of {', '.join(WORKERS)}, got {config.workers!r}")
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    dtype_name = config.dtype or _logged(choose_dtype([prefill, decode])).value
    limits = [model_config.max_position_embeddings, model_config.sliding_window or 1 << 30]
    max_model_len = min(limits + ([config.scheduler.max_model_len] if config.scheduler.max_model_len else []))
    prefill_cores, decode_cores = _split_cores(mode, config)
    return Plan(mode, prefill, prefill if mode == "colocated" else decode, DTYPES[dtype_name],
                max_model_len, prefill_cores, decode_cores)


def _default_mode(prefill: torch.device, decode: torch.device) -> str:
    """Adaptive wherever there are two compute units (two devices, or two CPU cores); else colocated."""
    if prefill.type == decode.type == "cpu" and len(os.sched_getaffinity(0)) < 2:
        return "colocated"
    return "adaptive"


def _devices(config: EngineConfig) -> tuple[torch.device, torch.device]:
    prefill, decode = config.prefill_device, config.decode_device
    if prefill is None or decode is None:
        choice = choose_devices(visible_gpus())
        if prefill is None and decode is None:
            logger.info("%s", choice)
        else:
            logger.info("%s device %s: %s", *(("prefill", choice.prefill) if prefill is None
                                               else ("decode", choice.decode)), choice.reason)
        prefill, decode = prefill or choice.prefill, decode or choice.decode
    return torch.device(prefill), torch.device(decode)


def _logged(choice: Choice) -> Choice:
    logger.info("%s", choice)
    return choice


def _split_cores(mode: str, config: EngineConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if mode == "colocated":
        return cores[:config.prefill_threads or len(cores)], ()
    half = max(len(cores) // 2, 1)
    prefill_n = config.prefill_threads or half
    decode_n = config.decode_threads or max(len(cores) - prefill_n, 1)
    if prefill_n + decode_n > len(cores):
        logger.warning("prefill (%d) + decode (%d) threads exceed the %d cores available; they will share",
                       prefill_n, decode_n, len(cores))
        return cores[:prefill_n], cores[-decode_n:]
    return cores[:prefill_n], cores[prefill_n:prefill_n + decode_n]


@dataclass(frozen=True, slots=True)
class Units:
    """The compute units of one engine: `decode` alone in colocated mode (it runs every step)."""

    decode: Compute
    prefill: Compute | None = None
    shared: tuple = ()               # what the units step over or were spawned with: closed last

    def all(self) -> tuple[Compute, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    def close(self) -> None:
        for unit in self.all():
            unit.close()
        for pool in self.shared:
            pool.close()


def load_units(config: EngineConfig, model_config: ModelConfig, plan: Plan, eos: frozenset[int]) -> Units:
    """Load the model(s), size the pools, warm up, and give each runner its compute thread.

    Raises ValueError on a bad setting or when a device cannot hold the model and a minimum pool."""
    sched, cache = config.scheduler, config.cache
    plan = replace(plan, prefill_device=with_index(plan.prefill_device), decode_device=with_index(plan.decode_device))
    for device in {plan.prefill_device, plan.decode_device}:
        kernels.check_backend(device)
    per_seq = blocks_for(plan.max_model_len, cache.block_size)
    graph_batch = sched.max_num_seqs if config.cuda_graph else 0
    if "cpu" in (plan.prefill_device.type, plan.decode_device.type):
        prepare_cpu_kernels(config.cpu_kernels, model_config, plan.dtype,
                            max(len({*plan.prefill_cores, *plan.decode_cores}), 1))
    step_sizes = dict(max_blocks_per_seq=per_seq, max_tokens=sched.max_prefill_tokens + sched.max_num_seqs,
                      max_seqs=2 * sched.max_num_seqs)
    sizer = PoolSizer(cache, sched, model_config, plan.dtype, plan.max_model_len,
                      {plan.prefill_device, plan.decode_device})          # NOTE: before any weights are loaded
    prefill_model = load_model(model_config, plan.dtype, plan.prefill_device, plan.max_model_len)
    if plan.mode == "colocated":
        _quantize(prefill_model, config, plan.prefill_cores)
        demand = sizer.demand("colocated", prefill_model, 1.0, per_seq * sched.max_num_seqs, graph_batch)
        [blocks] = sizer.blocks(plan.prefill_device, [demand])
        runner = ModelRunner(prefill_model, blocks, cache.block_size, eos, graph_batch, **step_sizes)
        warm_up_for_serving(runner, "colocated", sched, plan.max_model_len, step_thread_counts(plan))
        return Units(ThreadCompute(StepRunner(runner), "colocated", plan.prefill_cores))
    shared = plan.prefill_device == plan.decode_device
    decode_model = prefill_model if shared else load_model(model_config, plan.dtype, plan.decode_device,
                                                           plan.max_model_len)
    adaptive = plan.mode == "adaptive"
    prefill_cores, decode_cores = lending_cores(plan) if adaptive else (plan.prefill_cores, plan.decode_cores)
    _quantize(decode_model, config, decode_cores)      # NOTE: shared with prefill on one device
    prefill_blocks, decode_blocks = _split_pools(sizer, plan, prefill_model, decode_model, per_seq, graph_batch)
    decode_runner = ModelRunner(decode_model, decode_blocks, cache.block_size, eos, graph_batch, **step_sizes)
    prefill_runner = ModelRunner(prefill_model, prefill_blocks, cache.block_size, eos, **step_sizes)
    warm_up_for_serving(decode_runner, "colocated" if adaptive else "decode", sched, plan.max_model_len,
                        step_thread_counts(plan, decode_cores))
    warm_up_for_serving(prefill_runner, "prefill", sched, plan.max_model_len, step_thread_counts(plan, prefill_cores))
    transfer = select_transfer(plan.prefill_device, plan.decode_device, config.kv_transfer)
    return Units(ThreadCompute(StepRunner(decode_runner), "decode", decode_cores),
                 ThreadCompute(StepRunner(prefill_runner, transfer, decode_runner.kv_pool), "prefill", prefill_cores))


def step_thread_counts(plan: Plan, cores: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The CPU thread counts a unit on `cores` may step with: all of them, or in adaptive mode either
    actor's own share too (a step runs on its own cores while the other actor is busy)."""
    cores = plan.prefill_cores if cores is None else cores
    own = (len(plan.prefill_cores), len(plan.decode_cores)) if plan.mode == "adaptive" else ()
    return tuple(sorted({max(len(cores), 1), *own} - {0}))


def lending_cores(plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Adaptive mode on CPU: each unit may run on every core (how many threads is decided per step)."""
    if plan.decode_device.type == plan.prefill_device.type == "cpu":
        every = tuple(sorted({*plan.prefill_cores, *plan.decode_cores}))
        return every, every
    return plan.prefill_cores, plan.decode_cores


def wire_actors(config: EngineConfig, plan: Plan, units: Units, emit: Emit) -> list[Actor]:
    """Fresh actors (schedulers, block managers, no sequence) over loaded units, for `plan.mode`."""
    sched, cache = config.scheduler, config.cache
    if plan.mode == "colocated":
        return [ColocatedActor(units.decode, sched, cache.kv_watermark, plan.max_model_len, emit,
                               _overlap(config, plan.prefill_device, config.speculative),
                               cache.enable_prefix_caching, config.speculative)]
    if plan.mode == "adaptive":
        return _adaptive_actors(config, plan, units, emit)
    decode = DecodeActor(units.decode, sched, cache.kv_watermark, plan.max_model_len, emit,
                         _overlap(config, plan.decode_device, config.speculative), cache.enable_prefix_caching,
                         config.speculative)
    prefill = PrefillActor(units.prefill, decode, sched, plan.max_model_len, emit,
                           _overlap(config, plan.prefill_device), cache.enable_prefix_caching)
    return _wired(prefill, decode)


def _adaptive_actors(config: EngineConfig, plan: Plan, units: Units, emit: Emit) -> list[Actor]:
    """Adaptive mode: the decode actor places prompts and prefills some itself; on CPU cores are lent."""
    sched, cache = config.scheduler, config.cache
    on_cpu = plan.decode_device.type == "cpu" and plan.prefill_device.type == "cpu"
    share = CoreShare(len(plan.prefill_cores), len(plan.decode_cores)) if on_cpu else None
    decode_cost, prefill_cost = StepCostModel(), StepCostModel()
    itl_target = sched.itl_target_ms / 1e3 if sched.itl_target_ms else None
    policy = PlacementPolicy(decode_cost, prefill_cost, sched.max_prefill_tokens, itl_target,
                             sched.max_local_prefill_length, shared_cores=share is not None)
    decode = AdaptiveDecodeActor(units.decode, sched, cache.kv_watermark, plan.max_model_len, emit,
                                 _overlap(config, plan.decode_device, config.speculative),
                                 cache.enable_prefix_caching, config.speculative,
                                 policy=policy, cost=decode_cost, share=share)
    prefill = LendingPrefillActor(units.prefill, decode, sched, plan.max_model_len, emit,
                                  _overlap(config, plan.prefill_device), cache.enable_prefix_caching,
                                  cost=prefill_cost, share=share)
    decode.prefill_actor = prefill
    return _wired(prefill, decode)


def _wired(prefill: PrefillActor, decode: DecodeActor) -> list[Actor]:
    decode.send_to_prefill = prefill.send
    decode.on_blocks_freed = prefill.poke
    return [prefill, decode]


def _overlap(config: EngineConfig, device: torch.device, speculative=None) -> bool:
    """Async scheduling: forced by the config, else on for CUDA (off on CPU: bench/RESULTS.md, "Host work per step").

    Never for an actor that verifies drafts: its next step's positions depend on the drafts kept."""
    if speculative is not None:
        if config.async_scheduling:
            logger.warning("--async-scheduling is off for the decode side: speculative decoding is on")
        return False
    return config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"


def _split_pools(sizer: PoolSizer, plan: Plan, prefill_model, decode_model, per_seq: int,
                 graph_batch: int) -> tuple[int, int]:
    """(prefill, decode) pool blocks: one device's budget shared, or each device's own."""
    shared = plan.prefill_device == plan.decode_device
    prefill_share = PREFILL_SHARE_OF_SHARED_DEVICE if shared else 1.0
    prefill = sizer.demand("prefill", prefill_model, prefill_share, per_seq * 4)
    decode = sizer.demand("decode", decode_model, 1.0 - prefill_share if shared else 1.0,
                          per_seq * sizer.sched.max_num_seqs, graph_batch)
    if shared:
        prefill_blocks, decode_blocks = sizer.blocks(plan.prefill_device, [prefill, decode])
        return prefill_blocks, decode_blocks
    return sizer.blocks(plan.prefill_device, [prefill])[0], sizer.blocks(plan.decode_device, [decode])[0]


def _quantize(model, config: EngineConfig, cores: tuple[int, ...]) -> None:
    if config.quantization != "none":
        quantize_model(model, config.quantization, gguf_source(model.config.model_dir), max(len(cores), 1))
