"""Compute units for `--distributed-executor-backend ray`: one Ray actor per prefill and decode unit.

The serve process joins the Ray cluster (`--ray-address`, else Ray's own resolution: $RAY_ADDRESS, then
a cluster started on this machine) as its driver. A GPU unit asks Ray for one GPU, a CPU unit for its
threads; a role goes to the nodes that advertise its custom resource (`pdserve_prefill`,
`pdserve_decode`, `pdserve_colocated`) where any node does, anywhere otherwise. Every node loads the
model from the same path (--model), as vLLM's Ray executor expects. The pools are sized as
`--workers process` sizes them, each unit's in its own actor.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import ray

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import blocks_for
from pdserve.engine.topology import PREFILL_SHARE_OF_SHARED_DEVICE, Plan, Units, unit_names
from pdserve.engine.worker.memory import kv_layout, num_kv_blocks
from pdserve.engine.worker.processes.shared_pool import PoolSpec, check_pools_agree
from pdserve.engine.worker.processes.worker_process import WorkerSpec
from pdserve.engine.ray.compute import RayCompute

logger = logging.getLogger(__name__)
ROLE_RESOURCE = "pdserve_{role}"
ROLE_SHARE = 0.001           # of a role's custom resource per unit: it marks the node, CPUs and GPUs count units


class RayConnection:
    """This process's place in the Ray cluster; closed last, after the units (a connection made here ends)."""

    def __init__(self, address: str | None) -> None:
        self.owned = not ray.is_initialized()
        if self.owned:
            ray.init(address=address, log_to_driver=True, include_dashboard=False)
        self.resources = ray.cluster_resources()
        logger.info("Ray cluster: %d nodes, %s", len([n for n in ray.nodes() if n["Alive"]]),
                    {k: v for k, v in self.resources.items() if not k.startswith("node:")})

    def close(self) -> None:
        if self.owned and ray.is_initialized():
            ray.shutdown()


def load_ray_units(config: EngineConfig, model_config: ModelConfig, plan: Plan, eos: frozenset[int]) -> Units:
    connection = RayConnection(config.ray_address)
    try:
        return _started(_units(config, model_config, plan, eos, connection), connection)
    except BaseException:
        connection.close()
        raise


def _units(config: EngineConfig, model_config: ModelConfig, plan: Plan, eos: frozenset[int],
           connection: RayConnection) -> Units:
    sched, cache = config.scheduler, config.cache
    per_seq = blocks_for(plan.max_model_len, cache.block_size)
    layout = kv_layout(model_config, cache.block_size)

    def pool(share: float, useful: int) -> PoolSpec:
        blocks = num_kv_blocks(cache.kv_cache_memory, share, plan.decode_device, model_config, cache.block_size,
                               plan.dtype, useful)
        return PoolSpec(layout, blocks, plan.dtype)

    base = WorkerSpec("colocated", model_config, plan.dtype, "cpu", plan.max_model_len,
                      pool(1.0, per_seq * sched.max_num_seqs), eos,
                      dict(max_blocks_per_seq=per_seq, max_tokens=sched.max_prefill_tokens + sched.max_num_seqs,
                           max_seqs=2 * sched.max_num_seqs),
                      (), config.quantization, "colocated", sched,
                      log_level=logging.getLogger().getEffectiveLevel(), cpu_kernels=config.cpu_kernels)

    def unit(role: str, name: str, device, cores, pool_: PoolSpec, warmup: str, peers=()) -> RayCompute:
        threads = max(len(cores), 1)
        spec = replace(base, name=name, device="cuda:0" if device.type == "cuda" else "cpu", pool=pool_,
                       warmup_role=warmup, thread_counts=(threads,))
        return RayCompute(spec, threads, actor_options(role, device.type, threads, connection.resources),
                          peers)

    if plan.mode == "colocated":
        n = len(plan.prefill_devices)
        pool_ = pool(1.0 / n, per_seq * sched.max_num_seqs)
        return Units(tuple(unit("colocated", name, d, c, pool_, "colocated") for name, d, c in
                           zip(unit_names("colocated", n), plan.prefill_devices, plan.prefill_unit_cores)))
    n_prefill, n_decode = len(plan.prefill_devices), len(plan.decode_devices)
    decode_pool = pool((1.0 - PREFILL_SHARE_OF_SHARED_DEVICE) / n_decode, per_seq * sched.max_num_seqs)
    prefill_pool = pool(PREFILL_SHARE_OF_SHARED_DEVICE / n_prefill, per_seq * 4)
    check_pools_agree(prefill_pool, decode_pool)
    decode_role = "colocated" if plan.mode == "adaptive" else "decode"
    decodes = tuple(unit("decode", name, d, c, decode_pool, decode_role) for name, d, c in
                    zip(unit_names("decode", n_decode), plan.decode_devices, plan.decode_unit_cores))
    prefills = tuple(unit("prefill", name, d, c, prefill_pool, "prefill", decodes) for name, d, c in
                     zip(unit_names("prefill", n_prefill), plan.prefill_devices, plan.prefill_unit_cores))
    return Units(decodes, prefills)


def actor_options(role: str, device_type: str, threads: int, cluster: dict) -> dict:
    """Ray actor options for one unit: its GPU or its threads, and its role's nodes where the cluster names any."""
    options = {"num_gpus": 1, "num_cpus": 1} if device_type == "cuda" else {"num_cpus": threads}
    resource = ROLE_RESOURCE.format(role=role)
    if resource in cluster:
        options["resources"] = {resource: ROLE_SHARE}
    return options | {"max_restarts": 0, "max_task_retries": 0}   # NOTE: the supervisor restarts a lost unit


def _started(units: Units, connection: RayConnection) -> Units:
    """Wait for every actor (they load in parallel); one that cannot start stops them all."""
    try:
        for unit in units.all():
            unit.wait_ready()
    except BaseException:
        for unit in units.all():
            unit.kill()
        raise
    return replace(units, shared=(connection,))
