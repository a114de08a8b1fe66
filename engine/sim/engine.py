"""The simulated engine: a Plan and simulated units for a named accelerator (or the measured units of this
machine), wired into the engine's own actors and coordinator (`pdserve.engine.topology.wire_actors`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import torch

from pdserve.engine.config import DTYPES, EngineConfig
from pdserve.engine.coordinator.coordinator import Coordinator
from pdserve.engine.coordinator.planner import Planner
from pdserve.engine.coordinator.slo import Slos, derive_slos
from pdserve.engine.core.block_manager import blocks_for
from pdserve.engine.core.messages import ActorStats, FinishReason, Request, StepOutput
from pdserve.engine.engine import measure_units
from pdserve.engine.sim.hardware import Hardware
from pdserve.engine.sim.shapes import ModelShape
from pdserve.engine.sim.units import SimCompute, Timeline, UnitModel
from pdserve.engine.topology import MODES, Plan, Units, parse_devices, unit_names, wire_actors
from pdserve.engine.worker.memory import DEFAULT_KV_BUDGET, parse_memory

SIM_DTYPE = "bfloat16"          # what a named accelerator serves in (its dense bf16 figure is the one tabled)


@dataclass(frozen=True, slots=True)
class Target:
    """What the simulated units stand for: a model shape, a cost model, and either a named accelerator (its
    memory sizes the pools) or this machine's measured units (`plan` and their pools' `num_blocks`)."""

    shape: ModelShape
    cost: object                              # one cost model for every unit, or a tuple: one per unit
    hardware: Hardware | None = None
    plan: Plan | None = None
    num_blocks: tuple[int, ...] = ()          # measured: per unit, prefill units first
    dtype_bytes: int = 2


def named_plan(config: EngineConfig, shape: ModelShape) -> Plan:
    """make_plan's decisions for GPUs that are not here: the devices given (default cuda:0 prefill, cuda:1
    decode), adaptive unless a mode is given, bf16, no CPU cores."""
    prefill = parse_devices(str(config.prefill_device or "cuda:0"))
    decode = parse_devices(str(config.decode_device or "cuda:1"))
    mode = config.mode or "adaptive"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if any(d.type != "cuda" for d in (*prefill, *decode)):
        raise ValueError("a named --hardware simulates GPUs: give cuda devices (--prefill-device cuda:0, ...)")
    limits = [shape.max_position_embeddings] + ([config.scheduler.max_model_len] if config.scheduler.max_model_len
                                                else [])
    decode = prefill if mode == "colocated" else decode
    return Plan(mode, prefill, decode, DTYPES[SIM_DTYPE], min(limits), ((),) * len(prefill), ((),) * len(decode))


def named_pool_blocks(config: EngineConfig, plan: Plan, target: Target) -> tuple[int, ...]:
    """Blocks per unit on a named accelerator: the KV budget (--kv-cache-memory; a fraction counts weights
    in, as on CUDA) less one copy of the weights per device, split evenly between the units on a device,
    each capped at what it can use (a prefill unit: four longest prompts; else --max-num-seqs of them)."""
    devices = plan.prefill_devices + (() if plan.mode == "colocated" else plan.decode_devices)
    roles = ["colocated" if plan.mode == "colocated" else "prefill"] * len(plan.prefill_devices)
    roles += [] if plan.mode == "colocated" else ["decode"] * len(plan.decode_devices)
    absolute, fraction = parse_memory(config.cache.kv_cache_memory or DEFAULT_KV_BUDGET["cuda"])
    fraction = config.cache.gpu_memory_utilization or fraction          # of the device's memory, as here
    weights = target.shape.weight_params * target.dtype_bytes
    budget = absolute if absolute is not None else fraction * target.hardware.memory - weights
    block = block_bytes(target, config.cache.block_size)
    per_seq = blocks_for(plan.max_model_len, config.cache.block_size)
    blocks = []
    for device, role in zip(devices, roles):
        sharing = sum(d == device for d in devices)
        useful = per_seq * (4 if role == "prefill" else config.scheduler.max_num_seqs)
        blocks.append(min(int(budget / sharing) // block, useful))
    if min(blocks) < per_seq:
        raise ValueError(f"{target.hardware.name} cannot hold {target.shape.name}'s weights and one "
                         f"{plan.max_model_len}-token sequence's KV per unit; lower --max-model-len")
    return tuple(blocks)


def block_bytes(target: Target, block_size: int) -> int:
    return target.shape.kv_elements_per_token() * target.dtype_bytes * block_size


def simulated_units(config: EngineConfig, plan: Plan, target: Target) -> Units:
    """One SimCompute per unit; units on one device (or one CPU core set) share its timeline, and each
    prefill unit has a link of its own to every decode unit."""
    blocks = target.num_blocks or named_pool_blocks(config, plan, target)
    colocated = plan.mode == "colocated"
    eos = frozenset(target.shape.eos_token_ids)
    token = next(t for t in range(target.shape.vocab_size) if t not in eos)
    timelines: dict[tuple, Timeline] = {}
    size, per_block = config.cache.block_size, block_bytes(target, config.cache.block_size)

    costs = iter(target.cost if isinstance(target.cost, tuple) else (target.cost,) * len(blocks))

    def unit(device: torch.device, cores: tuple[int, ...], n: int, links: int) -> SimCompute:
        compute = timelines.setdefault((str(device), cores if device.type == "cpu" else ()), Timeline())
        return SimCompute(UnitModel(device, n, size, eos, token, next(costs), compute,
                                    tuple(Timeline() for _ in range(links)), per_block, max(len(cores), 1)))

    prefill_blocks, decode_blocks = blocks[:len(plan.prefill_devices)], blocks[len(plan.prefill_devices):]
    if colocated:
        return Units(tuple(unit(d, c, n, 0) for d, c, n in
                           zip(plan.prefill_devices, plan.prefill_unit_cores, prefill_blocks)))
    prefills = [unit(d, c, n, len(plan.decode_devices)) for d, c, n in
                zip(plan.prefill_devices, plan.prefill_unit_cores, prefill_blocks)]      # NOTE: first, as costs are
    decodes = tuple(unit(d, c, n, 0) for d, c, n in zip(plan.decode_devices, plan.decode_unit_cores, decode_blocks))
    prefills = tuple(prefills)
    return Units(decodes, prefills)


@dataclass(frozen=True, slots=True)
class Emitted:
    """One token of a request's stream, at virtual time `at`."""

    at: float
    finish_reason: FinishReason | None
    cached_tokens: int
    error: str | None = None


class SimEngine:
    """The coordinator and actors over simulated units, with a front that timestamps each token."""

    def __init__(self, config: EngineConfig, target: Target) -> None:
        self.config = config
        self.plan = target.plan or named_plan(config, target.shape)
        self.units = simulated_units(config, self.plan, target)
        prefill, decode = wire_actors(config, self.plan, self.units, self._on_step)
        self.coordinator = Coordinator(self.plan.mode, prefill, decode, clock=lambda: asyncio.get_running_loop().time())
        self.slos: Slos | None = None
        for role, actors in (("prefill", prefill), ("colocated" if self.mode == "colocated" else "decode", decode)):
            for index, (actor, name) in enumerate(zip(actors, unit_names(role, len(actors)))):
                actor.index, actor.unit_name = index, name
        pool_tokens = min(u.num_blocks * u.block_size for u in self.units.all())
        self.max_model_len = min(self.plan.max_model_len, pool_tokens)
        self.vocab_size = target.shape.vocab_size
        self._streams: dict[str, asyncio.Queue] = {}

    @property
    def mode(self) -> str:
        return self.plan.mode

    async def start(self) -> None:
        """As Engine.start: the units' cost models start from a profile of the (simulated) units and the SLOs
        not set are derived from it, then the adaptive mode's planner decides with them."""
        sched = self.config.scheduler
        measured = await measure_units(self.config, self.plan, self.units, self.vocab_size)
        self.slos = derive_slos(sched, self.plan.max_model_len, measured)
        if measured is not None:
            self.coordinator.learn_costs(measured)
        if self.mode == "adaptive":
            self.coordinator.planner = Planner(self.slos, sched.max_prefill_tokens)
        for actor in self.coordinator.actors:
            actor.start()

    async def stop(self) -> None:
        """Stop the actors (as Engine.stop does) and check that they hold no KV block."""
        for request_id in list(self._streams):
            self.coordinator.abort(request_id)
        for actor in self.coordinator.actors:
            await actor.stop()
        while any([actor.drain() for actor in self.coordinator.actors]):
            pass
        for actor in self.coordinator.actors:
            actor.settle()

    def submit(self, request: Request) -> asyncio.Queue:
        """Route `request` through the coordinator; its queue gets one Emitted per token.
        Raises ValueError for a prompt the engine would refuse (too long for the context window)."""
        if len(request.prompt_token_ids) + request.params.max_tokens > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens")
        if len(self._streams) >= self.config.scheduler.max_queue:
            raise ValueError(f"{len(self._streams)} requests in flight; the limit is {self.config.scheduler.max_queue}")
        if request.arrival_time == 0.0:
            request = replace(request, arrival_time=asyncio.get_running_loop().time())
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        self.coordinator.submit(request)
        return queue

    def _on_step(self, output: StepOutput) -> None:
        now = asyncio.get_running_loop().time()
        cached = output.cached_tokens or (0,) * len(output)
        for request_id, reason, hit in zip(output.request_ids, output.finish_reasons, cached):
            queue = self._streams.get(request_id)
            if queue is None:
                continue
            queue.put_nowait(Emitted(now, reason, hit, output.error if reason is FinishReason.ERROR else None))
            if reason is not None:
                del self._streams[request_id]
                self.coordinator.finished(request_id)

    def stats(self) -> list[ActorStats]:
        return [actor.stats() for actor in self.coordinator.actors]
