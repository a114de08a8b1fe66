"""The Ray actor that hosts one unit: the worker process's loop, its messages over Ray actor calls.

`step` takes the same versioned wire frame a worker process reads from its pipe and answers with the
same outcome (or error) frame. The pool's blocks leave through `read_blocks` and arrive through
`write_blocks` as raw bytes (a numpy array the object store moves between nodes without copying on
read). `write_blocks` is handed the bytes' reference inside a list, so Ray does not resolve it before
the call: the call is dispatched at once and fetches the bytes in its own concurrency group's thread.
An actor executes its calls in submission order, so a reference argument still being produced on the
prefill node would hold every later call, this unit's steps included, until it arrived; fetched here,
a hand-off lands while this unit steps (the rows it writes belong to no running sequence yet).

A decode unit's pool is a memfd segment (`shares_pool`) that a prefill unit's actor on the same node maps
(`attach_peer`) and copies into inside its step, as a worker process does (`pdserve.engine.ray.shared`).
"""
from __future__ import annotations

import os

import numpy as np
import ray
import torch

from pdserve.engine.ray.shared import PoolAddress, open_peer_pool, pool_address, with_peer
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.worker.processes.shared_pool import SharedPool, check_pools_agree
from pdserve.engine.worker.processes.worker_process import WorkerSpec, answer, build_step_runner
from pdserve.engine.worker.step_runner import Peer

KV_GROUP = "kv"
KV_THREADS = 4                       # hand-offs landing at once (each waits for its prefill step, then fetches)
LEASE_GROUP = "lease"                # answers pings while a step runs: the unit's liveness lease


class UnitActor:
    def __init__(self, spec: WorkerSpec, threads: int, shares_pool: bool = False) -> None:
        """`shares_pool`: the pool is a memfd segment a unit's actor on this node can map (a CPU decode unit)."""
        torch.set_num_threads(threads)
        self.spec = spec
        self.segment = SharedPool.create(spec.pool, spec.name) if shares_pool else None
        self.step_runner = build_step_runner(spec, None if self.segment is None else self.segment.ticket)
        self.pool = self.step_runner.runner.kv_pool       # [blocks, layers, 2, block_size, kv_heads, head_dim]
        self.bits = self.pool.view(torch.uint8).numpy() if self.pool.device.type == "cpu" else None

    def where(self) -> dict:
        """The node and process this unit runs in (log lines, error messages, tests)."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "threads": torch.get_num_threads()}

    @ray.method(concurrency_group=LEASE_GROUP)
    def ping(self) -> int:
        return os.getpid()

    def step(self, frame: bytes) -> bytes:
        """The outcome (or error) frame of one work frame; its copies into mapped peer pools have landed."""
        return answer(self.step_runner, frame)

    def pool_address(self) -> PoolAddress | None:
        """Where an actor on this node opens this unit's pool; None where it is not shared."""
        if self.segment is None:
            return None
        return pool_address(self.segment, ray.get_runtime_context().get_node_id())

    def attach_peer(self, index: int, address: PoolAddress) -> None:
        """Copy hand-offs to peer `index` (BlockCopy.peer) in this unit's steps, straight into the pool at
        `address`. Raises OSError or ValueError where that pool cannot be mapped or does not fit this one."""
        check_pools_agree(self.spec.pool, address.spec)
        pool = open_peer_pool(address)
        peer = Peer(select_transfer(self.pool.device, pool.device, self.spec.kv_transfer), pool)
        self.step_runner.peers = with_peer(self.step_runner.peers, index, peer)

    def detach_peers(self) -> None:
        """Unmap every peer's pool: hand-offs go through `read_blocks` from now on."""
        self.step_runner.peers = ()

    def attached_peers(self) -> list[int]:
        """The peers whose pools this unit's steps copy into."""
        return [index for index, peer in enumerate(self.step_runner.peers) if peer is not None]

    @ray.method(num_returns=2)
    def read_blocks(self, blocks: list[int]) -> tuple[np.ndarray, int]:
        """The blocks' bytes, in order ([len(blocks), layers, 2, block_size, kv_heads, head_dim * itemsize]),
        and their size: the caller waits on the size (the read is done) without pulling the bytes."""
        if self.bits is not None:
            data = self.bits[blocks]
        else:
            data = self.pool[torch.tensor(blocks, device=self.pool.device)].cpu().view(torch.uint8).numpy()
        return data, data.nbytes

    @ray.method(concurrency_group=KV_GROUP)
    def write_blocks(self, blocks: list[int], sent: list) -> int:
        """Store the bytes `sent[0]` (a reference to `read_blocks`' first value) into `blocks` of this pool;
        returns the bytes written. Raises the read's error where the read failed or its bytes are lost."""
        data = ray.get(sent[0])
        self._store(blocks, data)
        return data.nbytes

    def _store(self, blocks: list[int], data: np.ndarray) -> None:
        if self.bits is not None:
            self.bits[blocks] = data
        else:
            self.pool[torch.tensor(blocks, device=self.pool.device)] = \
                torch.from_numpy(data.copy()).to(self.pool.device).view(self.pool.dtype)


class GlooUnitActor(UnitActor):
    """A unit whose blocks can also move by Ray Direct Transport over gloo (`pdserve.engine.ray.transport`).
    A class of its own: a method with a tensor transport makes Ray run every call of the actor on a thread
    of its own, which the default transport has no need of."""

    @ray.method(tensor_transport="gloo")
    def read_blocks_gloo(self, blocks: list[int]) -> torch.Tensor:
        """The blocks, [len(blocks), layers, 2, block_size, kv_heads, head_dim] in host memory, kept here
        until Ray has sent them to the actor whose call takes this result."""
        return self.pool[torch.tensor(blocks, device=self.pool.device)].cpu()

    def fence(self) -> None:
        """Answers once the calls sent before it have run (this group runs calls one at a time, in order)."""

    @ray.method(concurrency_group=KV_GROUP)
    def write_blocks_gloo(self, blocks: list[int], data: torch.Tensor) -> int:
        self.pool[torch.tensor(blocks, device=self.pool.device)] = data.to(self.pool.device)
        return data.numel() * data.element_size()


def remote_unit_actor(gloo: bool = False, **options) -> type:
    """`UnitActor` (`GlooUnitActor` with `gloo`) as a Ray actor class with `options` (resources, restarts)."""
    return ray.remote(concurrency_groups={KV_GROUP: KV_THREADS, LEASE_GROUP: 1}, **options)(
        GlooUnitActor if gloo else UnitActor)
