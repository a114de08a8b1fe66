"""The Ray actor that hosts one unit: the worker process's loop, its messages over Ray actor calls.

`step` takes the same versioned wire frame a worker process reads from its pipe and answers with the
same outcome (or error) frame. The pool's blocks leave through `read_blocks` and arrive through
`write_blocks` as raw bytes (a numpy array the object store moves between nodes without copying on
read); `write_blocks` runs in its own concurrency group, so a prefill unit's hand-off lands while this
unit steps (the rows it writes belong to no running sequence yet).
"""
from __future__ import annotations

import os

import numpy as np
import ray
import torch

from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.processes.worker_process import WorkerSpec, build_step_runner

KV_GROUP = "kv"
LEASE_GROUP = "lease"                # answers pings while a step runs: the unit's liveness lease


class UnitActor:
    def __init__(self, spec: WorkerSpec, threads: int) -> None:
        torch.set_num_threads(threads)
        self.step_runner = build_step_runner(spec)
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
        try:
            outcome = self.step_runner.run(wire.decode_work(frame))
            return wire.encode_outcome(outcome)
        except Exception as e:                          # NOTE: reported in the reply, as a worker process does
            return wire.encode_error(e)

    def read_blocks(self, blocks: list[int]) -> np.ndarray:
        """The blocks' bytes, in order: [len(blocks), layers, 2, block_size, kv_heads, head_dim * itemsize]."""
        if self.bits is not None:
            return self.bits[blocks]
        return self.pool[torch.tensor(blocks, device=self.pool.device)].cpu().view(torch.uint8).numpy()

    @ray.method(concurrency_group=KV_GROUP)
    def write_blocks(self, blocks: list[int], data: np.ndarray) -> int:
        """Store `read_blocks`' bytes into `blocks` of this pool; returns the bytes written."""
        if self.bits is not None:
            self.bits[blocks] = data
        else:
            self.pool[torch.tensor(blocks, device=self.pool.device)] = \
                torch.from_numpy(data.copy()).to(self.pool.device).view(self.pool.dtype)
        return data.nbytes


def remote_unit_actor(**options) -> type:
    """`UnitActor` as a Ray actor class with `options` (resources, name, restarts)."""
    return ray.remote(concurrency_groups={KV_GROUP: 1, LEASE_GROUP: 1}, **options)(UnitActor)
