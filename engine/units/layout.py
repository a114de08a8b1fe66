"""Start-up's decisions as data: the options, the serving mode and the machine (its devices, dtype and cores)
turned into a Layout, one UnitSpec per unit. An option not given is chosen from the machine, and logged."""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from pdserve.engine.config import DTYPES, EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import blocks_for
from pdserve.engine.units.pools import pool_shares
from pdserve.engine.units.spec import CoreShare, Layout, StepBuffers, UnitSpec, deal_cores, parse_devices, unit_names
from pdserve.engine.worker.memory import kv_layout
from pdserve.engine.worker.window_pool import slot_blocks as window_slot_blocks
from pdserve.engine.worker.window_pool import wanted_slots
from pdserve.engine.worker.startup.defaults import choose_devices, choose_dtype, visible_gpus
from pdserve.engine.worker.state_pool import slot_blocks

logger = logging.getLogger(__name__)

WORKERS = ("thread", "process")


class UnitRoles(Protocol):
    """What the serving mode decides about its units (`engine.modes.base.Mode`)."""

    def unit_roles(self, prefill: Sequence[torch.device], decode: Sequence[torch.device]
                   ) -> list[tuple[str, torch.device]]: ...

    def cores_by_role(self, cores: tuple[int, ...], prefill_threads: int | None,
                      decode_threads: int | None) -> dict[str, tuple[int, ...]]: ...

    def warmup_role(self, role: str) -> str: ...

    def lends_cores(self, roles: Sequence[tuple[str, torch.device]]) -> bool: ...


def machine_devices(config: EngineConfig) -> tuple[tuple[torch.device, ...], tuple[torch.device, ...]]:
    """The prefill and decode devices: given, or chosen from the GPUs visible (logged). Raises ValueError for a
    CUDA device without CUDA."""
    prefill, decode = config.prefill_device, config.decode_device
    if prefill is None or decode is None:
        choice = choose_devices(visible_gpus())
        if prefill is None and decode is None:
            logger.info("%s", choice)
        else:
            logger.info("%s device %s: %s", *(("prefill", choice.prefill) if prefill is None
                                               else ("decode", choice.decode)), choice.reason)
        prefill, decode = prefill or choice.prefill, decode or choice.decode
    devices = parse_devices(str(prefill)), parse_devices(str(decode))
    for device in {*devices[0], *devices[1]}:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
    return devices


def machine_dtype(config: EngineConfig, devices: Sequence[torch.device]) -> torch.dtype:
    """The serving dtype: given, or the best the devices compute in (logged)."""
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.dtype is not None:
        return DTYPES[config.dtype]
    choice = choose_dtype(list(devices))
    logger.info("%s", choice)
    return DTYPES[choice.value]


def machine_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def make_layout(config: EngineConfig, model_config: ModelConfig, roles: UnitRoles,
                prefill: Sequence[torch.device], decode: Sequence[torch.device], dtype: torch.dtype,
                cores: tuple[int, ...]) -> Layout:
    """The units of `roles`' mode over these devices and cores, each with its pool's share and cap."""
    if config.workers not in WORKERS:
        raise ValueError(f"workers must be one of {', '.join(WORKERS)}, got {config.workers!r}")
    sched, block_size = config.scheduler, config.cache.block_size
    limits = [model_config.max_position_embeddings]      # NOTE: a window limits what a layer reads, not the context
    max_model_len = min(limits + ([sched.max_model_len] if sched.max_model_len else []))
    placed = roles.unit_roles(prefill, decode)
    by_role = roles.cores_by_role(cores, config.prefill_threads, config.decode_threads)
    lending = roles.lends_cores(placed) and config.distributed_executor_backend is None   # a Ray unit has its own CPUs
    shared = tuple(sorted({c for role_cores in by_role.values() for c in role_cores}))
    share = CoreShare(len(by_role["prefill"]), len(by_role["decode"])) if lending else None
    per_seq = blocks_for(max_model_len, block_size)
    window_seqs = sched.max_num_seqs if split_windows(config, model_config) else 0
    if not window_seqs:
        states = sched.max_num_seqs * slot_blocks(model_config, kv_layout(model_config, block_size), dtype)
    else:
        states = window_slot_blocks(model_config) * wanted_slots(model_config, block_size, window_seqs, per_seq)
    pools = [(share, cap + states) for share, cap in pool_shares(placed, per_seq, sched.max_num_seqs)]
    specs = []
    for role in dict.fromkeys(r for r, _ in placed):
        here = [i for i, (r, _) in enumerate(placed) if r == role]
        dealt = deal_cores(by_role[role], tuple(placed[i][1] for i in here))
        for index, (i, name, unit_cores) in enumerate(zip(here, unit_names(role, len(here)), dealt)):
            unit_cores = shared if lending else unit_cores
            specs.append(UnitSpec(role, index, name, placed[i][1], unit_cores,
                                  _thread_counts(share, unit_cores), roles.warmup_role(role), *pools[i],
                                  sched.max_num_seqs if config.cuda_graph and role != "prefill" else 0))
    buffers = StepBuffers(per_seq, sched.max_prefill_tokens + sched.max_num_seqs, 2 * sched.max_num_seqs)
    return Layout(tuple(specs), dtype, max_model_len, block_size, buffers, share, window_seqs)


def split_windows(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether a model mixing one window with full layers keeps its sliding layers' K and V for the window only:
    yes, unless KV tiers are on (a tier record holds a whole block)."""
    cache = config.cache
    return bool(model_config.split_window) and cache.kv_offload_memory is None and cache.kv_offload_disk is None


def _thread_counts(share: CoreShare | None, cores: tuple[int, ...]) -> tuple[int, ...]:
    """The CPU thread counts a unit on `cores` may step with: all of them, and with lending either unit's own
    share too (a step runs on its own cores while the other unit is busy)."""
    own = (share.prefill_own, share.decode_own) if share is not None else ()
    return tuple(sorted({max(len(cores), 1), *own} - {0}))
