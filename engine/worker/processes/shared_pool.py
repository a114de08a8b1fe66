"""A KV pool in shared memory, for worker processes on CPU: the decode pool, written directly by
the prefill worker (push) and read by the decode worker, with no KV byte through a pipe.

The segment is an anonymous `memfd` (Linux): it has no name, so nothing can be left behind in
/dev/shm by any exit path, SIGKILL included; it lives while a process holds its descriptor or a
mapping. The coordinator creates it (so a worker that dies can be spawned again onto the same
pool) and hands the descriptor to each worker at spawn.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from multiprocessing import reduction

import torch

from pdserve.kernels.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What both sides of a shared pool must agree on."""

    layout: KVLayout
    num_blocks: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes(self.dtype)


def check_pools_agree(prefill: PoolSpec, decode: PoolSpec) -> None:
    """ValueError naming both values unless blocks of one pool can be copied into the other as they are."""
    a, b = prefill.layout, decode.layout
    for what, mine, theirs in (("block size", a.block_size, b.block_size), ("dtype", prefill.dtype, decode.dtype),
                               ("layers", a.num_layers, b.num_layers), ("KV heads", a.num_kv_heads, b.num_kv_heads),
                               ("head dim", a.head_dim, b.head_dim)):
        if mine != theirs:
            raise ValueError(f"the prefill and decode KV pools disagree on {what}: prefill {mine}, decode {theirs}")


class SharedFd:
    """A file descriptor that travels to a spawned process (duplicated into it, as multiprocessing does for pipes)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> SharedFd:
    return SharedFd(dup.detach())


class SharedPool:
    def __init__(self, spec: PoolSpec, fd: SharedFd) -> None:
        self.spec, self.fd = spec, fd

    @classmethod
    def create(cls, spec: PoolSpec, name: str) -> SharedPool:
        fd = os.memfd_create(f"pdserve-kv-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, spec.nbytes)
        return cls(spec, SharedFd(fd))

    def tensor(self) -> torch.Tensor:
        """The pool, mapped into this process: [blocks, layers, 2, block_size, kv_heads, head_dim]."""
        if os.fstat(self.fd.fd).st_size != self.spec.nbytes:
            raise ValueError(f"shared pool segment holds {os.fstat(self.fd.fd).st_size} bytes, "
                             f"expected {self.spec.nbytes}")
        mapping = mmap.mmap(self.fd.fd, self.spec.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(mapping, dtype=self.spec.dtype)
        return flat.view(self.spec.layout.shape(self.spec.num_blocks))

    def close(self) -> None:
        if self.fd.fd >= 0:
            os.close(self.fd.fd)
            self.fd.fd = -1
