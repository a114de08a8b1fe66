"""Compute units for `--workers process`: one spawned worker per runner, the decode pools shared.

Each worker loads its own copy of the weights (the thread mode's CPU units share one) and builds
its runner from a WorkerSpec. Each decode pool is shared memory the engine creates (`share_pool`:
a memfd segment on CPU, GPU memory exported as a CUDA IPC handle on CUDA): its decode worker steps
over it and every prefill worker copies finished blocks straight into it. On a GPU the pools are
sized from the free memory this process sees before the workers load their weights.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import blocks_for
from pdserve.engine.units.layout import PREFILL_SHARE_OF_SHARED_DEVICE, Plan, Units, step_thread_counts, unit_cores, unit_names
from pdserve.engine.worker.startup.cpu_kernels import prepare_cpu_kernels
from pdserve.engine.worker.memory import kv_layout, num_kv_blocks
from pdserve.engine.worker.processes.process import ProcessCompute, SpawnTracker
from pdserve.engine.worker.processes.shared_pool import PoolSpec, check_pools_agree, share_pool, sharing_for
from pdserve.engine.worker.processes.worker_process import WorkerSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerPools:
    """The KV pools of a plan's out-of-process units (worker processes or Ray actors), as the thread units'
    are sized: colocated mode's, or the decode and prefill units' (each None where the mode has none)."""

    colocated: PoolSpec | None
    decode: PoolSpec | None
    prefill: PoolSpec | None
    decode_warmup_role: str          # an adaptive decode unit also prefills: warmed as a colocated one


def worker_pools(config: EngineConfig, model_config: ModelConfig, plan: Plan) -> WorkerPools:
    sched, cache = config.scheduler, config.cache
    per_seq = blocks_for(plan.max_model_len, cache.block_size)
    layout = kv_layout(model_config, cache.block_size)

    def pool(share: float, useful: int) -> PoolSpec:
        blocks = num_kv_blocks(cache.kv_cache_memory, share, plan.decode_device, model_config, cache.block_size,
                               plan.dtype, useful)
        return PoolSpec(layout, blocks, plan.dtype)

    decode_role = "colocated" if plan.mode == "adaptive" else "decode"
    if plan.mode == "colocated":
        return WorkerPools(pool(1.0 / len(plan.prefill_devices), per_seq * sched.max_num_seqs), None, None,
                           decode_role)
    decode = pool((1.0 - PREFILL_SHARE_OF_SHARED_DEVICE) / len(plan.decode_devices), per_seq * sched.max_num_seqs)
    prefill = pool(PREFILL_SHARE_OF_SHARED_DEVICE / len(plan.prefill_devices), per_seq * 4)
    check_pools_agree(prefill, decode)
    return WorkerPools(None, decode, prefill, decode_role)


def worker_spec(config: EngineConfig, model_config: ModelConfig, plan: Plan, eos: frozenset[int],
                pool: PoolSpec, device: str, cores: tuple[int, ...], cpu_kernels: str) -> WorkerSpec:
    """The spec every unit's spec is a `replace` of (its name, pool, cores, warm-up role and thread counts)."""
    sched = config.scheduler
    per_seq = blocks_for(plan.max_model_len, config.cache.block_size)
    return WorkerSpec("colocated", model_config, plan.dtype, device, plan.max_model_len, pool, eos,
                      dict(max_blocks_per_seq=per_seq, max_tokens=sched.max_prefill_tokens + sched.max_num_seqs,
                           max_seqs=2 * sched.max_num_seqs),
                      cores, config.quantization, "colocated", sched,
                      log_level=logging.getLogger().getEffectiveLevel(), cpu_kernels=cpu_kernels)


def load_process_units(config: EngineConfig, model_config: ModelConfig, plan: Plan,
                       eos: frozenset[int]) -> Units:
    for device in plan.devices:
        sharing_for(device)                  # NOTE: refuses CUDA devices where this process has no CUDA
    pools = worker_pools(config, model_config, plan)
    cpu_kernels = prepare_cpu_kernels(config.cpu_kernels, model_config, plan.dtype,
                                      max(len({*plan.prefill_cores, *plan.decode_cores}), 1)).value
    base = worker_spec(config, model_config, plan, eos, pools.colocated or pools.decode, str(plan.decode_device),
                       plan.prefill_cores, cpu_kernels)
    if plan.mode == "colocated":
        n = len(plan.prefill_devices)
        return started(Units(tuple(ProcessCompute(replace(base, name=name, cores=cores,
                                                           thread_counts=step_thread_counts(plan, cores)))
                                    for name, cores in
                                    zip(unit_names("colocated", n), plan.prefill_unit_cores)),
                              shared=(SpawnTracker(),)))
    prefill_cores, decode_cores = unit_cores(plan)
    n_prefill, n_decode = len(plan.prefill_devices), len(plan.decode_devices)
    decode_pool, prefill_pool = pools.decode, pools.prefill
    shared = []
    try:                               # NOTE: the segments stay open here, for workers spawned again later
        shared = [share_pool(decode_pool, device, name)
                  for device, name in zip(plan.decode_devices, unit_names("decode", n_decode))]
        decodes = tuple(ProcessCompute(replace(base, name=name, pool=decode_pool, cores=cores,
                                               warmup_role=pools.decode_warmup_role,
                                               thread_counts=step_thread_counts(plan, cores)),
                                       own_pool=pool_.ticket)
                        for name, cores, pool_ in zip(unit_names("decode", n_decode), decode_cores, shared))
        prefills = tuple(ProcessCompute(replace(base, name=name, pool=prefill_pool, cores=cores, warmup_role="prefill",
                                                peer_pools=(decode_pool,) * n_decode, kv_transfer=config.kv_transfer,
                                                thread_counts=step_thread_counts(plan, cores)),
                                        peer_pools=tuple(p.ticket for p in shared))
                         for name, cores in zip(unit_names("prefill", n_prefill), prefill_cores))
        return started(Units(decodes, prefills, shared=(*shared, SpawnTracker())))
    except BaseException:
        for segment in shared:
            segment.close()
        raise


def started(units: Units) -> Units:
    """Wait for every worker (they load in parallel); one that cannot start stops them all."""
    try:
        for unit in units.all():
            unit.wait_ready()
    except BaseException:
        for unit in units.all():
            unit.kill()
        raise
    return units
