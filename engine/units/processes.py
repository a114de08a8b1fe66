"""`--workers process`: one spawned worker per unit, each with its own copy of the weights, the decode pools
shared. Each decode pool is shared memory the engine creates (`share_pool`: a memfd segment on CPU, GPU
memory exported as a CUDA IPC handle on CUDA): its decode worker steps over it and every prefill worker
copies finished blocks straight into it. On a GPU the pools are sized from the memory free in this process
before the workers load their weights."""
from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.units.spec import Layout, UnitSpec
from pdserve.engine.units.tiers import make_tier_store
from pdserve.engine.units.units import Units
from pdserve.engine.worker.memory import kv_layout, num_kv_blocks
from pdserve.engine.worker.processes.process import ProcessCompute, SpawnTracker
from pdserve.engine.worker.processes.shared_pool import PoolSpec, check_pools_agree, share_pool, sharing_for
from pdserve.engine.worker.processes.worker_process import WorkerSpec
from pdserve.engine.worker.startup.cpu_kernels import prepare_cpu_kernels

logger = logging.getLogger(__name__)


def worker_pools(config: EngineConfig, model_config: ModelConfig, layout: Layout) -> tuple[PoolSpec, ...]:
    """Each unit's pool for units outside this process (worker processes or Ray actors): its share of its
    device's budget (`engine.units.pools`), the budget read before any worker loads."""
    cache = config.cache
    split = bool(layout.window_seqs)
    kv = kv_layout(model_config, cache.block_size, split)
    pools = tuple(PoolSpec(kv, num_kv_blocks(cache.kv_cache_memory, spec.pool_share, spec.device, model_config,
                                             cache.block_size, layout.dtype, spec.pool_cap, split), layout.dtype)
                  for spec in layout.units)
    for pool, spec in zip(pools, layout.units):
        if not spec.decodes:
            for other in pools:
                check_pools_agree(pool, other)
    return pools


def worker_spec(config: EngineConfig, model_config: ModelConfig, layout: Layout, eos: frozenset[int],
                spec: UnitSpec, pool: PoolSpec, cpu_kernels: str) -> WorkerSpec:
    """What unit `spec`'s worker builds its runner from (a prefill unit's `peer_pools` are added by its caller)."""
    b = layout.buffers
    return WorkerSpec(spec.name, model_config, layout.dtype, str(spec.device), layout.max_model_len, pool, eos,
                      dict(max_blocks_per_seq=b.blocks_per_seq, buffer_tokens=b.tokens, buffer_seqs=b.seqs),
                      spec.cores, config.quantization, spec.warmup_role, config.scheduler,
                      log_level=logging.getLogger().getEffectiveLevel(), cpu_kernels=cpu_kernels,
                      thread_counts=spec.thread_counts, window_seqs=layout.window_seqs)


def load_process_units(config: EngineConfig, model_config: ModelConfig, layout: Layout, eos: frozenset[int]) -> Units:
    for device in layout.devices:
        sharing_for(device)                  # NOTE: refuses CUDA devices where this process has no CUDA
    pools = worker_pools(config, model_config, layout)
    cpu_kernels = prepare_cpu_kernels(config.cpu_kernels, model_config, layout.dtype,
                                      max(len(layout.cores), 1)).value
    store = make_tier_store(config, model_config, layout, shared=True)
    specs = [replace(worker_spec(config, model_config, layout, eos, spec, pool, cpu_kernels),
                     tiers=store and store.ticket) for spec, pool in zip(layout.units, pools)]
    shared: dict[int, object] = {}
    try:                               # NOTE: the segments stay open here, for workers spawned again later
        for i, spec in enumerate(layout.units):
            if spec.role == "decode":
                shared[i] = share_pool(pools[i], spec.device, spec.name)
        tickets, decode_pools = tuple(s.ticket for s in shared.values()), tuple(pools[i] for i in shared)
        computes = tuple(ProcessCompute(worker, own_pool=shared[i].ticket if i in shared else None) if spec.decodes
                         else ProcessCompute(replace(worker, peer_pools=decode_pools, kv_transfer=config.kv_transfer,
                                                     kv_verify=config.cache.kv_verify),
                                             peer_pools=tickets)
                         for i, (spec, worker) in enumerate(zip(layout.units, specs)))
        kept = (*shared.values(), *((store,) if store else ()), SpawnTracker())
        return started(Units(layout.units, computes, shared=kept, tiers=store))
    except BaseException:
        for segment in (*shared.values(), *((store,) if store else ())):
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
