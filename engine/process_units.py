"""Compute units for `--workers process`: one spawned worker per runner, the decode pool shared.

Each worker loads its own copy of the weights (the thread mode's two CPU actors share one) and
builds its runner from a WorkerSpec. The decode pool is a shared-memory segment the coordinator
creates: the decode worker steps over it and the prefill worker copies finished blocks straight
into it. CPU only: sharing a CUDA pool between processes needs CUDA IPC handles, not built yet.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from engine.config import EngineConfig, ModelConfig
from engine.core.block_manager import blocks_for
from engine.topology import PREFILL_SHARE_OF_SHARED_DEVICE, Plan, Units, lending_cores, step_thread_counts
from engine.worker.startup.cpu_kernels import prepare_cpu_kernels
from engine.worker.memory import kv_layout, num_kv_blocks
from engine.worker.processes.process import ProcessCompute, SpawnTracker
from engine.worker.processes.shared_pool import PoolSpec, SharedPool, check_pools_agree
from engine.worker.processes.worker_process import WorkerSpec

logger = logging.getLogger(__name__)


def load_process_units(config: EngineConfig, model_config: ModelConfig, plan: Plan,
                       eos: frozenset[int]) -> Units:
    if "cuda" in (plan.prefill_device.type, plan.decode_device.type):
        raise ValueError("--workers process runs CPU actors only: sharing a CUDA KV pool between processes "
                         "(CUDA IPC handles) is not built yet; use --workers thread on GPUs")
    sched, cache = config.scheduler, config.cache
    per_seq = blocks_for(plan.max_model_len, cache.block_size)
    layout = kv_layout(model_config, cache.block_size)

    def pool(share: float, useful: int) -> PoolSpec:
        blocks = num_kv_blocks(cache.kv_cache_memory, share, plan.decode_device, model_config, cache.block_size,
                               plan.dtype, useful)
        return PoolSpec(layout, blocks, plan.dtype)

    base = WorkerSpec("colocated", model_config, plan.dtype, str(plan.decode_device), plan.max_model_len,
                      pool(1.0, per_seq * sched.max_num_seqs), eos,
                      dict(max_blocks_per_seq=per_seq, max_tokens=sched.max_prefill_tokens + sched.max_num_seqs,
                           max_seqs=2 * sched.max_num_seqs),
                      plan.prefill_cores, config.quantization, "colocated", sched,
                      log_level=logging.getLogger().getEffectiveLevel(),
                      cpu_kernels=prepare_cpu_kernels(config.cpu_kernels, model_config, plan.dtype,
                                                      max(len({*plan.prefill_cores, *plan.decode_cores}), 1)).value,
                      thread_counts=step_thread_counts(plan))
    if plan.mode == "colocated":
        return _started(Units(ProcessCompute(base), shared=(SpawnTracker(),)))
    prefill_cores, decode_cores = lending_cores(plan) if plan.mode == "adaptive" else (plan.prefill_cores,
                                                                                       plan.decode_cores)
    decode_pool = pool(1.0 - PREFILL_SHARE_OF_SHARED_DEVICE, per_seq * sched.max_num_seqs)
    prefill_pool = pool(PREFILL_SHARE_OF_SHARED_DEVICE, per_seq * 4)
    check_pools_agree(prefill_pool, decode_pool)
    shared = SharedPool.create(decode_pool, "decode")
    decode = replace(base, name="decode", pool=decode_pool, cores=decode_cores,
                     warmup_role="colocated" if plan.mode == "adaptive" else "decode",
                     thread_counts=step_thread_counts(plan, decode_cores))
    prefill = replace(base, name="prefill", pool=prefill_pool, cores=prefill_cores, warmup_role="prefill",
                      thread_counts=step_thread_counts(plan, prefill_cores),
                      peer_pool=decode_pool, kv_transfer=config.kv_transfer)
    try:                               # NOTE: the segment stays open here, for workers spawned again later
        return _started(Units(ProcessCompute(decode, own_pool=shared.fd),
                              ProcessCompute(prefill, peer_pool=shared.fd), shared=(shared, SpawnTracker())))
    except BaseException:
        shared.close()
        raise


def _started(units: Units) -> Units:
    """Wait for every worker (they load in parallel); one that cannot start stops them all."""
    try:
        for unit in units.all():
            unit.wait_ready()
    except BaseException:
        for unit in units.all():
            unit.kill()
        raise
    return units
