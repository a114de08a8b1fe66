"""What a simulation runs: the engine itself (`Engine`: its front, mode, coordinator and actors) over simulated
units, for a named accelerator or for this machine's measured units, on the loop's virtual clock."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import torch

from pdserve.engine.config import DTYPES, EngineConfig, ModelConfig
from pdserve.engine.engine import Engine, Machine
from pdserve.engine.served import ServedModel
from pdserve.engine.sim.hardware import Hardware
from pdserve.engine.sim.units import CoreSet, SimCompute, Timeline, UnitModel
from pdserve.engine.units.pools import blocks_within
from pdserve.engine.units.spec import Layout, parse_devices
from pdserve.engine.units.units import Units
from pdserve.engine.worker.memory import DEFAULT_KV_BUDGET, parse_memory

SIM_DTYPE = "bfloat16"          # what a named accelerator serves in (its dense bf16 figure is the one tabled)


@dataclass(frozen=True, slots=True)
class Target:
    """What the simulated units stand for: a model, a cost model, and either a named accelerator (its memory
    sizes the pools) or this machine's measured units (`machine` and their pools' `num_blocks`)."""

    shape: ModelConfig
    cost: object                              # one cost model for every unit, or a tuple: one per unit
    hardware: Hardware | None = None
    machine: Machine | None = None
    num_blocks: tuple[int, ...] = ()          # measured: per unit, prefill units first
    dtype_bytes: int = 2


def simulated_engine(config: EngineConfig, target: Target) -> Engine:
    """The engine over `target`'s simulated units; call it on the virtual clock's loop (`clock.run_virtual`)."""
    config = replace(config, step_timeout=0.0)      # NOTE: a simulated unit never hangs; no watchdog wakes the clock
    eos = frozenset(target.shape.eos_token_ids)
    served = ServedModel(target.shape.name, None, target.shape, None, eos)
    loop = asyncio.get_running_loop()
    return Engine(config, served, target.machine or named_machine(config), _loader(target), clock=loop.time,
                  keep_profile=False)


def named_machine(config: EngineConfig) -> Machine:
    """The GPUs that are not here: the devices given (default cuda:0 prefill, cuda:1 decode), bf16, no CPU."""
    prefill = parse_devices(str(config.prefill_device or "cuda:0"))
    decode = parse_devices(str(config.decode_device or "cuda:1"))
    if any(d.type != "cuda" for d in (*prefill, *decode)):
        raise ValueError("a named --hardware simulates GPUs: give cuda devices (--prefill-device cuda:0, ...)")
    return Machine(prefill, decode, DTYPES[SIM_DTYPE], ())


def named_pool_blocks(config: EngineConfig, layout: Layout, target: Target) -> tuple[int, ...]:
    """Blocks per unit on a named accelerator: the KV budget (--kv-cache-memory; a fraction counts weights in, as
    on CUDA) less one copy of the weights per device, shared between the units on a device as the pool rule says."""
    absolute, fraction = parse_memory(config.cache.kv_cache_memory or DEFAULT_KV_BUDGET["cuda"])
    fraction = config.cache.gpu_memory_utilization or fraction          # of the device's memory, as here
    weights = target.shape.stored_params * target.dtype_bytes
    budget = absolute if absolute is not None else fraction * target.hardware.memory - weights
    block = block_bytes(target, config.cache.block_size)
    blocks = tuple(blocks_within(budget, spec.pool_share, spec.pool_cap, block) for spec in layout.units)
    if min(blocks) < layout.buffers.blocks_per_seq:
        raise ValueError(f"{target.hardware.name} cannot hold {target.shape.name}'s weights and one "
                         f"{layout.max_model_len}-token sequence's KV per unit; lower --max-model-len")
    return blocks


def block_bytes(target: Target, block_size: int) -> int:
    return target.shape.kv_elements_per_token() * target.dtype_bytes * block_size


def _loader(target: Target):
    def load(config: EngineConfig, model_config: ModelConfig, layout: Layout, eos: frozenset[int]) -> Units:
        """One SimCompute per unit; units on one device (or one CPU core set) share its cores, and each prefill
        unit has a link of its own to every unit that decodes."""
        blocks = target.num_blocks or named_pool_blocks(config, layout, target)
        token = next(t for t in range(model_config.vocab_size) if t not in eos)
        costs = target.cost if isinstance(target.cost, tuple) else (target.cost,) * len(blocks)
        core_sets: dict[tuple, CoreSet] = {}
        size, per_block, links = config.cache.block_size, block_bytes(target, config.cache.block_size), \
            len(layout.decoding)
        computes = []
        for spec, n, cost in zip(layout.units, blocks, costs):
            device = torch.device(spec.device)
            cores = spec.cores if device.type == "cpu" else ()
            shared = core_sets.setdefault((str(device), cores), CoreSet([0.0] * max(len(cores), 1)))
            computes.append(SimCompute(UnitModel(device, n, size, eos, token, cost, shared,
                                                 tuple(Timeline() for _ in range(0 if spec.decodes else links)),
                                                 per_block, layout.own_threads(spec))))
        return Units(layout.units, tuple(computes))
    return load
