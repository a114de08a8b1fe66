"""Compute units for `--distributed-executor-backend ray`: one Ray actor per prefill and decode unit.

The serve process joins the Ray cluster (`--ray-address`, else Ray's own resolution: $RAY_ADDRESS, then
a cluster started on this machine) as its driver. A GPU unit asks Ray for one GPU, a CPU unit for its
threads; a role goes to the nodes that advertise its custom resource (`pdserve_prefill`,
`pdserve_decode`, `pdserve_colocated`) where any node does, anywhere otherwise. Every node loads the
model from the same path (--model), as vLLM's Ray executor expects. The pools are sized as
`--workers process` sizes them, each unit's in its own actor; a CPU decode unit's is a memfd segment that
the prefill units on its node map once all units have started (`pdserve.engine.ray.shared`).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import ray

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.units.processes import started, worker_pools, worker_spec
from pdserve.engine.units.spec import Layout, UnitSpec
from pdserve.engine.units.units import Units
from pdserve.engine.worker.processes.shared_pool import PoolSpec
from pdserve.engine.ray.compute import START_TIMEOUT_S, RayCompute, first_line
from pdserve.engine.ray.shared import PoolAddress
from pdserve.engine.ray.transport import KVTransport

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


def load_ray_units(config: EngineConfig, model_config: ModelConfig, layout: Layout, eos: frozenset[int]) -> Units:
    connection = RayConnection(config.ray_address)
    try:
        transport = KVTransport(config.ray_kv_transport)
        units = started(_units(config, model_config, layout, eos, connection, transport))
        transport.connect([unit.actor for unit in units.all()])
        share_same_node_pools(units)
        return replace(units, shared=(connection,))
    except BaseException:
        connection.close()
        raise


def _units(config: EngineConfig, model_config: ModelConfig, layout: Layout, eos: frozenset[int],
           connection: RayConnection, transport: KVTransport) -> Units:
    pools = worker_pools(config, model_config, layout)

    def unit(spec: UnitSpec, pool: PoolSpec, peers=()) -> RayCompute:
        threads = layout.own_threads(spec)
        worker = replace(worker_spec(config, model_config, layout, eos, spec, pool, config.cpu_kernels), cores=(),
                         device="cuda:0" if spec.device.type == "cuda" else "cpu", thread_counts=(threads,))
        return RayCompute(worker, threads, actor_options(spec.role, spec.device.type, threads, connection.resources),
                          peers, transport, shares_pool=spec.role == "decode" and spec.device.type == "cpu")

    decoding = {i: unit(spec, pool) for i, (spec, pool) in enumerate(zip(layout.units, pools)) if spec.decodes}
    peers = tuple(decoding.values())
    computes = tuple(decoding[i] if i in decoding else unit(spec, pool, peers)
                     for i, (spec, pool) in enumerate(zip(layout.units, pools)))
    return Units(layout.units, computes)


def share_same_node_pools(units: Units) -> None:
    """Each prefill unit's actor maps the shared pool of every decode unit on its node; logs, once, how KV
    goes between each pair (an attempt that fails with a warning: that pair uses the transport)."""
    addresses = [_pool_address(decode) for decode in units.decoding]
    for prefill in units.prefills:
        for index, (decode, address) in enumerate(zip(units.decoding, addresses)):
            _pair(prefill, index, decode, address)


def _pool_address(decode: RayCompute) -> PoolAddress | None:
    try:
        return ray.get(decode.actor.pool_address.remote(), timeout=START_TIMEOUT_S)
    except ray.exceptions.RayError:
        return None                      # NOTE: its actor is gone: its first step fails and names it


def _pair(prefill: RayCompute, index: int, decode: RayCompute, address: PoolAddress | None) -> None:
    pair, transport = f"KV {prefill.spec.name} -> {decode.spec.name}", prefill.transport.name
    if address is None:
        logger.info("%s: %s (the decode pool is not in shared memory)", pair, transport)
    elif address.node_id != prefill.where["node_id"]:
        logger.info("%s: %s, %s to %s", pair, transport, prefill.node, decode.node)
    else:
        try:
            prefill.attach(index, address)
        except ray.exceptions.RayError as e:
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
            logger.warning("%s: %s, though both are on %s: the prefill unit cannot map %s: %s", pair, transport,
                           prefill.node, address.path, first_line(cause))
            return
        logger.info("%s: shared memory on %s", pair, prefill.node)


def actor_options(role: str, device_type: str, threads: int, cluster: dict) -> dict:
    """Ray actor options for one unit: its GPU or its threads, and its role's nodes where the cluster names any."""
    options = {"num_gpus": 1, "num_cpus": 1} if device_type == "cuda" else {"num_cpus": threads}
    resource = ROLE_RESOURCE.format(role=role)
    if resource in cluster:
        options["resources"] = {resource: ROLE_SHARE}
    return options | {"max_restarts": 0, "max_task_retries": 0}   # NOTE: the supervisor restarts a lost unit
