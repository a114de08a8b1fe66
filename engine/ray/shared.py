"""Ray units on one node share the decode pool, as `--workers process` does on one host.

A decode unit's actor holds its KV pool in a memfd segment it creates
(`pdserve.engine.worker.processes.shared_pool`) and reports its `PoolAddress`. A prefill unit's actor on
the same node opens it through /proc/<pid>/fd/<fd> and writes its hand-offs straight in, inside its step:
one copy, no Ray call, no object store. `pdserve.engine.ray.units` pairs the units once all have started;
a pair on two nodes, or one whose segment cannot be opened (no /proc, another user), goes through the
transport (`pdserve.engine.ray.transport`). A restarted actor is a new process with a new pool, so after
any unit's restart every pair goes through the transport for good (`KVTransport.fall_back`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.engine.worker.processes.shared_pool import PoolSpec, SharedFd, SharedPool, open_shared
from pdserve.engine.worker.step_runner import Peer


@dataclass(frozen=True, slots=True)
class PoolAddress:
    """Where a process on node `node_id` opens a unit's shared pool: /proc/<pid>/fd/<fd>, which must be
    the segment `identity` names."""

    node_id: str
    pid: int
    fd: int
    identity: tuple[int, int]           # (st_dev, st_ino) of the segment
    spec: PoolSpec

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


def pool_address(segment: SharedPool, node_id: str) -> PoolAddress:
    """The address of `segment`, held open by this process on node `node_id`."""
    stat = os.fstat(segment.fd.fd)
    return PoolAddress(node_id, os.getpid(), segment.fd.fd, (stat.st_dev, stat.st_ino), segment.spec)


def open_peer_pool(address: PoolAddress) -> torch.Tensor:
    """The pool at `address`, mapped into this process ([blocks, layers, 2, block_size, kv_heads, head_dim]).

    Raises OSError where /proc does not open it (no /proc, another user, the process gone) and ValueError
    where what opens is not that segment or not that pool."""
    fd = os.open(address.path, os.O_RDWR | os.O_CLOEXEC)
    try:
        stat = os.fstat(fd)
        if (stat.st_dev, stat.st_ino) != address.identity:
            raise ValueError(f"{address.path} is not the segment the decode unit reported (another pid namespace?)")
        return open_shared(address.spec, SharedFd(fd))         # NOTE: the mapping keeps a descriptor of its own
    finally:
        os.close(fd)


def with_peer(peers: tuple[Peer | None, ...], index: int, peer: Peer) -> tuple[Peer | None, ...]:
    """`peers` with `peer` at `index` (BlockCopy.peer), None at the indices no peer holds."""
    padded = [*peers, *[None] * (index + 1 - len(peers))]
    padded[index] = peer
    return tuple(padded)
