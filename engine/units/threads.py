"""`--workers thread` (the default): each unit's runner steps on a thread of this process, pinned to its device or
CPU cores. Units on one device share one copy of the weights."""
from __future__ import annotations

from dataclasses import replace

from pdserve import kernels
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.units.spec import Layout, UnitSpec
from pdserve.engine.units.tiers import make_tier_store
from pdserve.engine.units.units import Units
from pdserve.engine.worker.compute import ThreadCompute, share_cores
from pdserve.engine.worker.device import with_index
from pdserve.engine.worker.memory import keep_freed_memory_in_process
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.startup.cpu_kernels import prepare_cpu_kernels
from pdserve.engine.worker.startup.sizing import PoolSizer
from pdserve.engine.worker.startup.warmup import warm_up_for_serving
from pdserve.engine.worker.step_runner import Peer, StepRunner


def load_thread_units(config: EngineConfig, model_config: ModelConfig, layout: Layout, eos: frozenset[int]) -> Units:
    """Load the model(s), size the pools, warm up, and give each runner its compute thread. Raises ValueError on
    a bad setting or when a device cannot hold the model and a minimum pool."""
    specs = tuple(_indexed(spec) for spec in layout.units)
    if any(spec.device.type == "cpu" for spec in specs):
        keep_freed_memory_in_process()
    for device in dict.fromkeys(spec.device for spec in specs):
        kernels.check_backend(device)
    if any(spec.device.type == "cpu" for spec in specs):
        prepare_cpu_kernels(config.cpu_kernels, model_config, layout.dtype, max(len(layout.cores), 1))
    sizer = PoolSizer(config.cache, config.scheduler, model_config, layout.dtype, layout.max_model_len,
                      {spec.device for spec in specs}, split=bool(layout.window_seqs))   # NOTE: before any weights
    models = _models(config, model_config, layout, specs)
    blocks = _pool_blocks(sizer, specs, models)
    b = layout.buffers
    runners = [ModelRunner(models[spec.device], n, config.cache.block_size, eos, spec.graph_batch,
                           max_blocks_per_seq=b.blocks_per_seq, buffer_tokens=b.tokens, buffer_seqs=b.seqs,
                           state_slots=config.scheduler.max_num_seqs, window_seqs=layout.window_seqs)
               for spec, n in zip(specs, blocks)]
    for spec, runner in zip(specs, runners):
        warm_up_for_serving(runner, spec.warmup_role, config.scheduler, layout.max_model_len, spec.thread_counts)
    decoding = [(spec, runner) for spec, runner in zip(specs, runners) if spec.decodes]
    store = make_tier_store(config, model_config, layout, shared=False)
    computes = tuple(ThreadCompute(StepRunner(runner, () if spec.decodes else _peers(config, spec, decoding),
                                              store and store.copier(spec.device), config.cache.kv_verify),
                                   spec.name, spec.cores) for spec, runner in zip(specs, runners))
    share_cores(computes)
    return Units(layout.units, computes, shared=(store,) if store else (), tiers=store)


def _indexed(spec: UnitSpec) -> UnitSpec:
    """`spec` on a device with its index (`cuda` is `cuda:0`): units on one device are found by it."""
    return replace(spec, device=with_index(spec.device))


def _models(config: EngineConfig, model_config: ModelConfig, layout: Layout, specs: tuple[UnitSpec, ...]) -> dict:
    """One model per device, quantized where units that decode step on it."""
    models = {}
    for device in dict.fromkeys(spec.device for spec in specs):
        decoding = [spec for spec in specs if spec.decodes and spec.device == device]
        cores = {c for spec in decoding for c in spec.cores}
        models[device] = load_model(model_config, layout.dtype, device, layout.max_model_len,
                                    config.quantization if decoding else "none", max(len(cores), 1))
    return models


def _pool_blocks(sizer: PoolSizer, specs: tuple[UnitSpec, ...], models: dict) -> list[int]:
    """Each unit's pool blocks: its share of its device's budget, as the sizer measures that budget."""
    blocks = [0] * len(specs)
    for device in dict.fromkeys(spec.device for spec in specs):
        here = [i for i, spec in enumerate(specs) if spec.device == device]
        demands = [sizer.demand(specs[i].role, models[device], specs[i].pool_share, specs[i].pool_cap,
                                specs[i].graph_batch) for i in here]
        for i, n in zip(here, sizer.blocks(device, demands)):
            blocks[i] = n
    return blocks


def _peers(config: EngineConfig, spec: UnitSpec, decoding: list[tuple[UnitSpec, ModelRunner]]) -> tuple[Peer, ...]:
    """Where prefill unit `spec` copies its hand-offs: every decode unit's pool."""
    return tuple(Peer(select_transfer(spec.device, d.device, config.kv_transfer), r.kv_pool) for d, r in decoding)
