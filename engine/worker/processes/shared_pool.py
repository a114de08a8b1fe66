"""A KV pool in shared memory, for worker processes: the decode pool, written directly by the prefill
worker (push) and read by the decode worker, with no KV byte through a pipe. On CPU it is a memfd
segment (below); on a GPU it is device memory shared through a CUDA IPC handle
(`pdserve.engine.transfer.cuda_ipc`). `share_pool` chooses, once, from the decode device; a worker
opens what it was handed with `open_shared`.

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

from pdserve.engine.transfer.cuda_ipc import CudaIpcHandle, CudaIpcPool, CudaIpcUnavailable
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


def sharing_for(device: torch.device) -> str:
    """How worker processes share a pool on `device`: "cuda-ipc" on a GPU, "memfd" on CPU.

    Raises CudaIpcUnavailable when `device` is CUDA and this process has no CUDA (the coordinator
    allocates and exports the GPU pools)."""
    device = torch.device(device)
    if device.type != "cuda":
        return SharedPool.name
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable(f"--workers process on {device} shares its KV pools through CUDA IPC, "
                                 f"and CUDA is not available in this process")
    return CudaIpcPool.name


def share_pool(spec: PoolSpec, device: torch.device, name: str) -> SharedPool | CudaIpcPool:
    """A decode pool for worker processes on `device`: exported through CUDA IPC on a GPU, a memfd segment
    on CPU. Its `ticket` goes to each worker (`open_shared`); CudaIpcUnavailable says why a GPU pool cannot."""
    if sharing_for(device) == CudaIpcPool.name:
        return CudaIpcPool.create(spec.layout.shape(spec.num_blocks), spec.dtype, device)
    return SharedPool.create(spec, name)


def open_shared(spec: PoolSpec, ticket: SharedFd | CudaIpcHandle) -> torch.Tensor:
    """The shared pool `ticket` names, in this (worker) process; ValueError if it is not the pool `spec` says."""
    if isinstance(ticket, SharedFd):
        return SharedPool(spec, ticket).tensor()
    expected = (tuple(spec.layout.shape(spec.num_blocks)), spec.dtype)
    if (ticket.shape, ticket.dtype) != expected:
        raise ValueError(f"the shared CUDA pool is {ticket.shape} {ticket.dtype}, expected {expected[0]} {expected[1]}")
    return ticket.open()


def new_segment(name: str, nbytes: int) -> SharedFd:
    """An anonymous shared-memory segment of `nbytes` (zeros)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return SharedFd(fd)


def map_segment(fd: SharedFd, nbytes: int) -> torch.Tensor:
    """Segment `fd` mapped into this process, as flat uint8; ValueError unless it holds `nbytes`."""
    size = os.fstat(fd.fd).st_size
    if size != nbytes:
        raise ValueError(f"shared memory segment holds {size} bytes, expected {nbytes}")
    mapping = mmap.mmap(fd.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class SharedPool:
    name = "memfd"

    def __init__(self, spec: PoolSpec, fd: SharedFd) -> None:
        self.spec, self.fd = spec, fd

    @property
    def ticket(self) -> SharedFd:
        """What a worker is handed to open the pool."""
        return self.fd

    @classmethod
    def create(cls, spec: PoolSpec, name: str) -> SharedPool:
        return cls(spec, new_segment(f"pdserve-kv-{name}", spec.nbytes))

    def tensor(self) -> torch.Tensor:
        """The pool, mapped into this process: [blocks, layers, 2, block_size, kv_heads, head_dim]."""
        flat = map_segment(self.fd, self.spec.nbytes).view(self.spec.dtype)
        return flat.view(self.spec.layout.shape(self.spec.num_blocks))

    def close(self) -> None:
        if self.fd.fd >= 0:
            os.close(self.fd.fd)
            self.fd.fd = -1
