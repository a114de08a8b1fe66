"""Turn an EngineConfig into loaded models, sized KV pools, compute units, and actors wired over them."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pdserve import kernels
from pdserve.engine.modes.adaptive.actors import AdaptiveDecodeActor, CoreShare, LendingPrefillActor
from pdserve.engine.actors.base import Actor, Emit
from pdserve.engine.actors.colocated import ColocatedActor
from pdserve.engine.actors.decode import DecodeActor
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.actors.prefill import PrefillActor
from pdserve.engine.config import DTYPES, EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import blocks_for
from pdserve.engine.model.quant import gguf_source, quantize_model
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.worker.compute import Compute, ThreadCompute, share_cores
from pdserve.engine.worker.startup.cpu_kernels import prepare_cpu_kernels
from pdserve.engine.worker.startup.defaults import Choice, choose_devices, choose_dtype, visible_gpus
from pdserve.engine.worker.device import with_index
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.startup.sizing import PoolSizer
from pdserve.engine.worker.step_runner import Peer, StepRunner
from pdserve.engine.worker.startup.warmup import warm_up_for_serving

logger = logging.getLogger(__name__)

PREFILL_SHARE_OF_SHARED_DEVICE = 0.25   # a device's KV budget for its prefill units next to decode units: capped at
#                                         what four max-length prompts use (_pools), it only bounds that cap; deriving it
#                                         needs the pool sizer to hand the decode units what prefill cannot use
MODES = ("adaptive", "disaggregated", "colocated")
WORKERS = ("thread", "process")


@dataclass(frozen=True, slots=True)
class Plan:
    """Decisions made once at start-up: one device and one core set per unit.

    Colocated mode runs its units on the prefill devices (`decode_devices` repeats them)."""

    mode: str
    prefill_devices: tuple[torch.device, ...]
    decode_devices: tuple[torch.device, ...]
    dtype: torch.dtype
    max_model_len: int
    prefill_unit_cores: tuple[tuple[int, ...], ...]     # per prefill (colocated: per colocated) unit; () off CPU
    decode_unit_cores: tuple[tuple[int, ...], ...]

    @property
    def prefill_device(self) -> torch.device:
        return self.prefill_devices[0]

    @property
    def decode_device(self) -> torch.device:
        return self.decode_devices[0]

    @property
    def prefill_cores(self) -> tuple[int, ...]:
        return tuple(sorted({c for cores in self.prefill_unit_cores for c in cores}))

    @property
    def decode_cores(self) -> tuple[int, ...]:
        return tuple(sorted({c for cores in self.decode_unit_cores for c in cores}))

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return (*self.prefill_devices, *self.decode_devices)

    @property
    def lending(self) -> bool:
        """Adaptive mode on one CPU prefill and one CPU decode unit: the two lend each other their cores."""
        return (self.mode == "adaptive" and len(self.prefill_devices) == len(self.decode_devices) == 1
                and self.prefill_device.type == self.decode_device.type == "cpu")


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory a --model value names (see `pdserve.engine.model.resolve`)."""
    return resolve_model(model).path


def make_plan(config: EngineConfig, model_config: ModelConfig) -> Plan:
    """Devices, mode, dtype and cores; an option not given is chosen from the machine (and logged)."""
    prefill, decode = _devices(config)
    for device in {*prefill, *decode}:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
    mode = config.mode or _default_mode(prefill[0], decode[0])
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if config.workers not in WORKERS:
        raise ValueError(f"workers must be one of {', '.join(WORKERS)}, got {config.workers!r}")
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    dtype_name = config.dtype or _logged(choose_dtype([*prefill, *decode])).value
    limits = [model_config.max_position_embeddings, model_config.sliding_window or 1 << 30]
    max_model_len = min(limits + ([config.scheduler.max_model_len] if config.scheduler.max_model_len else []))
    if mode == "colocated":
        decode = prefill
    prefill_cores, decode_cores = _split_cores(mode, config)
    return Plan(mode, prefill, decode, DTYPES[dtype_name], max_model_len,
                _deal(prefill_cores, prefill), _deal(decode_cores, decode))


def parse_devices(spec: str) -> tuple[torch.device, ...]:
    """A --prefill-device / --decode-device value: one device per unit, comma-separated (`cpu,cpu`, `cuda:0,cuda:1`)."""
    names = [name.strip() for name in spec.split(",")]
    if not all(names):
        raise ValueError(f"a device list names one device per unit, comma-separated; got {spec!r}")
    return tuple(torch.device(name) for name in names)


def _deal(cores: tuple[int, ...], devices: tuple[torch.device, ...]) -> tuple[tuple[int, ...], ...]:
    """Split `cores` between the CPU units of `devices` (contiguous, as even as possible; fewer cores than
    units: they share, round robin); a GPU unit gets none."""
    cpu = [i for i, device in enumerate(devices) if device.type == "cpu"]
    dealt: list[tuple[int, ...]] = [()] * len(devices)
    if len(cores) < len(cpu):
        for n, i in enumerate(cpu):
            dealt[i] = (cores[n % len(cores)],) if cores else ()
        return tuple(dealt)
    start = 0
    for n, i in enumerate(cpu):
        size = len(cores) // len(cpu) + (n < len(cores) % len(cpu))
        dealt[i], start = cores[start:start + size], start + size
    return tuple(dealt)


def _default_mode(prefill: torch.device, decode: torch.device) -> str:
    """Adaptive wherever there are two compute units (two devices, or two CPU cores); else colocated."""
    if prefill.type == decode.type == "cpu" and len(os.sched_getaffinity(0)) < 2:
        return "colocated"
    return "adaptive"


def _devices(config: EngineConfig) -> tuple[tuple[torch.device, ...], tuple[torch.device, ...]]:
    prefill, decode = config.prefill_device, config.decode_device
    if prefill is None or decode is None:
        choice = choose_devices(visible_gpus())
        if prefill is None and decode is None:
            logger.info("%s", choice)
        else:
            logger.info("%s device %s: %s", *(("prefill", choice.prefill) if prefill is None
                                               else ("decode", choice.decode)), choice.reason)
        prefill, decode = prefill or choice.prefill, decode or choice.decode
    return parse_devices(str(prefill)), parse_devices(str(decode))


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
    """The compute units of one engine: in colocated mode `decodes` alone (each runs every step)."""

    decodes: tuple[Compute, ...]
    prefills: tuple[Compute, ...] = ()
    shared: tuple = ()               # what the units step over or were spawned with: closed last
    costs: dict = field(default_factory=dict)   # (role, index) -> its StepCostModel: kept over actor restarts
    drafters: tuple = ()             # per decode (colocated) unit: its draft model (method draft_model)

    @property
    def decode(self) -> Compute:
        return self.decodes[0]

    @property
    def prefill(self) -> Compute | None:
        return self.prefills[0] if self.prefills else None

    def all(self) -> tuple[Compute, ...]:
        return (*self.prefills, *self.decodes)

    def cost(self, role: str, index: int) -> StepCostModel:
        """Unit `index` of `role` ("prefill", or "decode" for decode and colocated units): its step cost model."""
        return self.costs.setdefault((role, index), StepCostModel())

    def close(self) -> None:
        for unit in self.all():
            unit.close()
        for pool in self.shared:
            pool.close()


def unit_names(role: str, count: int) -> list[str]:
    """`prefill` for a role's only unit, else `prefill0`, `prefill1`, ... (logs, metrics, PDSERVE_FAULT)."""
    return [role] if count == 1 else [f"{role}{i}" for i in range(count)]


def load_units(config: EngineConfig, model_config: ModelConfig, plan: Plan, eos: frozenset[int]) -> Units:
    """Load the model(s), size the pools, warm up, and give each runner its compute thread.

    Units on one device share one copy of the weights (CPU units: one copy in the process).
    Raises ValueError on a bad setting or when a device cannot hold the model and a minimum pool."""
    sched, cache = config.scheduler, config.cache
    plan = replace(plan, prefill_devices=tuple(map(with_index, plan.prefill_devices)),
                   decode_devices=tuple(map(with_index, plan.decode_devices)))
    for device in dict.fromkeys(plan.devices):
        kernels.check_backend(device)
    per_seq = blocks_for(plan.max_model_len, cache.block_size)
    graph_batch = sched.max_num_seqs if config.cuda_graph else 0
    if any(device.type == "cpu" for device in plan.devices):
        prepare_cpu_kernels(config.cpu_kernels, model_config, plan.dtype,
                            max(len({*plan.prefill_cores, *plan.decode_cores}), 1))
    step_sizes = dict(max_blocks_per_seq=per_seq, max_tokens=sched.max_prefill_tokens + sched.max_num_seqs,
                      max_seqs=2 * sched.max_num_seqs)
    sizer = PoolSizer(cache, sched, model_config, plan.dtype, plan.max_model_len,
                      set(plan.devices))          # NOTE: before any weights are loaded
    colocated = plan.mode == "colocated"
    roles = [("colocated" if colocated else "prefill", d) for d in plan.prefill_devices]
    roles += [] if colocated else [("decode", d) for d in plan.decode_devices]
    models = _models(config, model_config, plan, colocated)
    blocks = _pools(sizer, roles, models, per_seq, graph_batch)
    runners = [ModelRunner(models[device], n, cache.block_size, eos, graph_batch if role != "prefill" else 0,
                           **step_sizes) for (role, device), n in zip(roles, blocks)]
    adaptive = plan.mode == "adaptive"
    cores = plan.prefill_unit_cores if colocated else sum(unit_cores(plan), ())
    for (role, _), runner, own in zip(roles, runners, cores):
        warm_up_for_serving(runner, "colocated" if adaptive and role == "decode" else role, sched, plan.max_model_len,
                            step_thread_counts(plan, own))
    if colocated:
        names = unit_names("colocated", len(runners))
        return Units(tuple(ThreadCompute(StepRunner(r), n, c)
                           for r, n, c in zip(runners, names, plan.prefill_unit_cores)))
    prefill_runners, decode_runners = runners[:len(plan.prefill_devices)], runners[len(plan.prefill_devices):]
    prefill_cores, decode_cores = unit_cores(plan)
    decodes = tuple(ThreadCompute(StepRunner(r), n, c) for r, n, c in
                    zip(decode_runners, unit_names("decode", len(decode_runners)), decode_cores))
    prefills = tuple(ThreadCompute(StepRunner(r, _peers(config, device, plan.decode_devices, decode_runners)), n, c)
                     for r, device, n, c in zip(prefill_runners, plan.prefill_devices,
                                                unit_names("prefill", len(prefill_runners)), prefill_cores))
    share_cores((*prefills, *decodes))
    return Units(decodes, prefills)


def _models(config: EngineConfig, model_config: ModelConfig, plan: Plan, colocated: bool) -> dict:
    """One model per device, quantized where decode (or colocated) units step on it, as before lists."""
    models = {}
    for device in dict.fromkeys(plan.devices):
        models[device] = load_model(model_config, plan.dtype, device, plan.max_model_len)
    stepping = plan.prefill_devices if colocated else plan.decode_devices
    for device in dict.fromkeys(stepping):
        cores = {c for d, cs in zip(stepping, plan.prefill_unit_cores if colocated else unit_cores(plan)[1])
                 if d == device for c in cs}
        _quantize(models[device], config, tuple(cores))
    return models


def _pools(sizer: PoolSizer, roles: list[tuple[str, torch.device]], models: dict, per_seq: int,
           graph_batch: int) -> list[int]:
    """Each unit's pool blocks. One device's budget is shared by the units on it: a quarter for its
    prefill units next to decode units (PREFILL_SHARE_OF_SHARED_DEVICE), split evenly within a role."""
    blocks = [0] * len(roles)
    for device in dict.fromkeys(d for _, d in roles):
        here = [i for i, (_, d) in enumerate(roles) if d == device]
        prefills = [i for i in here if roles[i][0] == "prefill"]
        others = [i for i in here if roles[i][0] != "prefill"]
        prefill_share = PREFILL_SHARE_OF_SHARED_DEVICE if prefills and others else 1.0
        demands = []
        for i in here:
            role = roles[i][0]
            others_share = 1.0 - (prefill_share if prefills else 0.0)
            share = prefill_share / len(prefills) if role == "prefill" else others_share / len(others)
            useful = per_seq * (4 if role == "prefill" else sizer.sched.max_num_seqs)
            demands.append(sizer.demand(role, models[device], share, useful, 0 if role == "prefill" else graph_batch))
        for i, n in zip(here, sizer.blocks(device, demands)):
            blocks[i] = n
    return blocks


def _peers(config: EngineConfig, device: torch.device, decode_devices, decode_runners) -> tuple[Peer, ...]:
    """Where a prefill unit on `device` copies its hand-offs: every decode unit's pool."""
    return tuple(Peer(select_transfer(device, d, config.kv_transfer), r.kv_pool)
                 for d, r in zip(decode_devices, decode_runners))


def step_thread_counts(plan: Plan, cores: tuple[int, ...]) -> tuple[int, ...]:
    """The CPU thread counts a unit on `cores` may step with: all of them, and with lending either
    unit's own share too (a step runs on its own cores while the other unit is busy)."""
    own = (len(plan.prefill_cores), len(plan.decode_cores)) if plan.lending else ()
    return tuple(sorted({max(len(cores), 1), *own} - {0}))


def unit_cores(plan: Plan) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Each prefill and decode unit's cores. Lending (one CPU unit each, adaptive): both may run on every
    core, how many threads is decided per step."""
    if plan.lending:
        every = tuple(sorted({*plan.prefill_cores, *plan.decode_cores}))
        return (every,), (every,)
    return plan.prefill_unit_cores, plan.decode_unit_cores


def wire_actors(config: EngineConfig, plan: Plan, units: Units, emit: Emit) -> tuple[list[Actor], list[Actor]]:
    """Fresh actors (schedulers, block managers, no sequence) over loaded units, for `plan.mode`:
    (prefill actors, decode actors); colocated mode has colocated actors in the second list alone."""
    return [wire_actor(config, plan, units, emit, "prefill", i) for i in range(len(units.prefills))], \
        [wire_actor(config, plan, units, emit, "decode", i) for i in range(len(units.decodes))]


def wire_actor(config: EngineConfig, plan: Plan, units: Units, emit: Emit, role: str, index: int) -> Actor:
    """A fresh actor over unit `index` of `role` (a restarted unit gets one alone)."""
    sched, cache = config.scheduler, config.cache
    caching = cache.enable_prefix_caching
    drafter = units.drafters[index] if units.drafters and role != "prefill" else None
    if plan.mode == "colocated":
        unit = units.decodes[index]
        return _costed(ColocatedActor(unit, sched, cache.kv_watermark, plan.max_model_len, emit,
                                      _overlap(config, plan.prefill_devices[index], config.speculative), caching,
                                      config.speculative, drafter), StepCostModel(), learns=True)
    device = (plan.prefill_devices if role == "prefill" else plan.decode_devices)[index]
    unit = (units.prefills if role == "prefill" else units.decodes)[index]
    overlap = _overlap(config, device, None if role == "prefill" else config.speculative)
    if plan.mode == "disaggregated":
        if role == "prefill":
            return PrefillActor(unit, sched, plan.max_model_len, emit, overlap, caching)
        return _costed(DecodeActor(unit, sched, cache.kv_watermark, plan.max_model_len, emit, overlap, caching,
                                   config.speculative, drafter), StepCostModel(), learns=True)
    share = core_share(plan)
    cost = units.cost(role, index)
    if role == "prefill":
        return LendingPrefillActor(unit, sched, plan.max_model_len, emit, overlap, caching, cost=cost, share=share)
    return _costed(AdaptiveDecodeActor(unit, sched, cache.kv_watermark, plan.max_model_len, emit, overlap, caching,
                                       config.speculative, drafter, cost=cost, share=share), cost, learns=False)


def core_share(plan: Plan) -> CoreShare | None:
    """The thread counts the two units of a lending plan step with; None without lending."""
    return CoreShare(len(plan.prefill_cores), len(plan.decode_cores)) if plan.lending else None


def _costed(actor: Actor, cost: StepCostModel, learns: bool) -> Actor:
    """`actor`, its speculator (if any) predicting verification costs from `cost`; `learns`: the speculator
    feeds `cost` the actor's steps (adaptive mode's actor feeds its own model)."""
    if actor.speculator is not None:
        actor.speculator.gate.use(cost, learns)
    return actor


def _overlap(config: EngineConfig, device: torch.device, speculative=None) -> bool:
    """Async scheduling: forced by the config, else on for CUDA (off on CPU: bench/RESULTS.md, "Host work per step").

    Never for an actor that verifies drafts: its next step's positions depend on the drafts kept."""
    if speculative is not None:
        if config.async_scheduling:
            logger.warning("--async-scheduling is off for the decode side: speculative decoding is on")
        return False
    return config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"


def _quantize(model, config: EngineConfig, cores: tuple[int, ...]) -> None:
    if config.quantization != "none":
        quantize_model(model, config.quantization, gguf_source(model.config.model_dir), max(len(cores), 1))
