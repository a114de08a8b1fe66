"""The KV tiers' bytes in worker processes: the host tier lives in a memfd segment the engine creates (as the
shared decode pools do), the disk tier in its file; each worker maps the one and opens the other, and copies
through them as a thread unit does."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.worker.processes.shared_pool import SharedFd, map_segment, new_segment
from pdserve.engine.worker.tiers.disk import DiskTier
from pdserve.engine.worker.tiers.host import HostTier, host_tier_bytes


@dataclass(frozen=True, slots=True)
class TierTicket:
    """How a worker opens the tiers, fastest first: ("host", segment, slots) and ("disk", path, slots)."""

    key: bytes
    block_bytes: int
    tiers: tuple[tuple[str, object, int], ...]


def shared_host_tier(num_slots: int, block_bytes: int, key: bytes) -> tuple[HostTier, SharedFd]:
    """A host tier in a new memfd segment, mapped here, and the segment for the workers."""
    segment = new_segment("pdserve-kv-host-tier", host_tier_bytes(num_slots, block_bytes))
    return HostTier(map_segment(segment, host_tier_bytes(num_slots, block_bytes)), num_slots, block_bytes, key), \
        segment


def open_tiers(ticket: TierTicket) -> tuple:
    """The tiers `ticket` names, opened in this (worker) process."""
    opened = []
    for kind, where, slots in ticket.tiers:
        if kind == "host":
            buffer = map_segment(where, host_tier_bytes(slots, ticket.block_bytes))
            opened.append(HostTier(buffer, slots, ticket.block_bytes, ticket.key))
        else:
            opened.append(DiskTier.open(where, slots, ticket.block_bytes, ticket.key))
    return tuple(opened)
