"""The KV tiers of one engine (--kv-offload-memory, --kv-offload-disk), made once at start-up beside the units:
the index every actor shares (`engine.core.kv_tiers`) and the bytes every runner copies through
(`engine.worker.tiers`), keyed by everything that makes a block's bytes valid here."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.kv_tiers import KVTiers
from pdserve.engine.core.tier_index import TierIndex
from pdserve.engine.model.cache import cache_root
from pdserve.engine.units.spec import Layout
from pdserve.engine.worker.memory import kv_layout, parse_memory
from pdserve.engine.worker.processes.shared_tiers import TierTicket, shared_host_tier
from pdserve.engine.worker.tiers.cuda_copier import tier_copier
from pdserve.engine.worker.tiers.copier import TierCopier
from pdserve.engine.worker.tiers.disk import DiskTier, disk_tier_slots
from pdserve.engine.worker.tiers.host import HostTier, host_tier_slots
from pdserve.engine.worker.tiers.records import model_files, validity_key

logger = logging.getLogger(__name__)

TIERS_FOLDER = "kv-tiers"        # the disk tier's default home in the cache folder


def parse_size(option: str, text: str) -> int:
    """A tier size in bytes (4GiB, 512MiB); ValueError naming `option` otherwise."""
    try:
        size, fraction = parse_memory(text)
    except ValueError:
        size, fraction = None, None
    if size is None or fraction is not None or size <= 0:
        raise ValueError(f"{option} {text!r}: expected a size in bytes, e.g. 4GiB")
    return size


def parse_offload_disk(text: str) -> tuple[str, int]:
    """`[PATH:]SIZE` -> (folder, bytes); the folder defaults to kv-tiers in the cache folder."""
    folder, sep, size = text.rpartition(":")
    if sep and not folder:
        raise ValueError(f"--kv-offload-disk {text!r}: expected [PATH:]SIZE, e.g. /var/cache/pdserve/kv:20GiB")
    return str(Path(folder).expanduser() if folder else cache_root() / TIERS_FOLDER), \
        parse_size("--kv-offload-disk", size)


class TierStore:
    """`index`: the slots, for the actors; `tiers`: their bytes in this process; `ticket`: for worker processes."""

    def __init__(self, index: KVTiers, tiers: tuple, ticket: TierTicket | None, segments: tuple = ()) -> None:
        self.index, self.tiers, self.ticket, self._segments = index, tiers, ticket, segments

    def copier(self, device: torch.device) -> TierCopier:
        return tier_copier(self.tiers, device)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        for segment in self._segments:
            if segment.fd >= 0:
                os.close(segment.fd)
                segment.fd = -1


def tier_key(config: EngineConfig, model_config: ModelConfig, layout: Layout) -> bytes:
    """Everything that makes a block's KV bytes valid here: a block written under another key is never read.

    NOTE: --quantization and --cpu-kernels as given, not what their start-up probes chose: a probe that changes its
    mind at a restart changes the numerics no more than the pool's own prefix cache already mixes (KV computed by
    decode steps, read by prefill), and keying on it would turn a kept tier cold at random."""
    return validity_key({"model": model_files(model_config.model_dir), "dtype": str(layout.dtype),
                         "quantization": config.quantization, "cpu_kernels": config.cpu_kernels,
                         "block_size": layout.block_size,
                         "kv_layout": repr(kv_layout(model_config, layout.block_size)),
                         "devices": sorted({device.type for device in layout.devices})})


def make_tier_store(config: EngineConfig, model_config: ModelConfig, layout: Layout, shared: bool) -> TierStore | None:
    """The tiers the options ask for (None: none): the host tier in a memfd segment where worker processes share it
    (`shared`), pinned where a GPU copies through it; the disk tier's file locked, its records indexed (a record
    that fails its header check is dropped and counted). Raises ValueError when a size holds no block."""
    cache = config.cache
    if cache.kv_offload_memory is None and cache.kv_offload_disk is None:
        return None
    key = tier_key(config, model_config, layout)
    block_bytes = kv_layout(model_config, layout.block_size).block_bytes(layout.dtype)
    indexes, tiers, tickets, segments = [], [], [], []
    if cache.kv_offload_memory is not None:
        slots = _slots("--kv-offload-memory", host_tier_slots(cache.kv_offload_memory, block_bytes), block_bytes)
        if shared:
            host, segment = shared_host_tier(slots, block_bytes, key)
            segments.append(segment)
        else:
            host = HostTier.allocate(slots, block_bytes, key, pin=any(d.type == "cuda" for d in layout.devices))
        indexes.append(TierIndex("host", slots))
        tiers.append(host)
        tickets.append(("host", segments[-1] if shared else None, slots))
    if cache.kv_offload_disk is not None:
        folder, size = cache.kv_offload_disk
        slots = _slots("--kv-offload-disk", disk_tier_slots(size, block_bytes), block_bytes)
        disk = DiskTier.own(Path(folder), slots, block_bytes, key)
        index = TierIndex("disk", slots)
        held, bad = disk.scan()
        index.restore(held)
        index.bad_blocks += bad
        logger.info("disk tier %s: %d blocks of %d kept from before%s", disk.path, len(held), slots,
                    f", {bad} damaged records dropped" if bad else "")
        indexes.append(index)
        tiers.append(disk)
        tickets.append(("disk", str(disk.path), slots))
    ticket = TierTicket(key, block_bytes, tuple(tickets)) if shared else None
    return TierStore(KVTiers(indexes, layout.block_size, block_bytes), tuple(tiers), ticket, tuple(segments))


def _slots(option: str, slots: int, block_bytes: int) -> int:
    if slots < 1:
        raise ValueError(f"{option}: too small for one KV block ({block_bytes} bytes and its header)")
    return slots
