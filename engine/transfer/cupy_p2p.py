"""The "cupy-p2p" KV transfer backend: cudaMemcpyPeerAsync per coalesced block run.

A peer copy that fails at run time does not fail its request: the backend logs a warning once and
copies through pinned host memory (`pdserve.engine.transfer.staged`) from then on.
"""
from __future__ import annotations

import logging

import torch

from pdserve.engine.transfer.base import KVTransfer, TransferHandle, TransferUnavailable, run_bytes, timing_events
from pdserve.engine.transfer.staged import StagedTransfer

logger = logging.getLogger(__name__)
PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


class PeerAccessUnavailable(TransferUnavailable):
    """CuPy and CUDA work, but the two devices cannot (or may not) access each other's memory."""


class CupyP2PTransfer(KVTransfer):
    """Copies block runs with `cupy.cuda.runtime.memcpyPeerAsync` on a transfer stream of the source device.

    The stream first waits on the caller's current stream of the source device; completion and
    duration come from CUDA events recorded around the copies. Peer access must already be enabled
    (`make_cupy_p2p` does it).
    """

    name = "cupy-p2p"

    def __init__(self, runtime, src_device: torch.device, dst_device: torch.device):
        self._runtime = runtime   # cupy.cuda.runtime
        self._src, self._dst = src_device, dst_device
        self._stream = torch.cuda.Stream(device=src_device)
        self._fallback: StagedTransfer | None = None

    def _copy_runs(self, src_pool, dst_pool, runs, block_bytes) -> TransferHandle:
        if self._fallback is not None:
            return self._fallback._copy_runs(src_pool, dst_pool, runs, block_bytes)
        self._stream.wait_stream(torch.cuda.current_stream(self._src))
        start, end = timing_events()
        try:
            with torch.cuda.device(self._src):
                start.record(self._stream)
                self._memcpy_runs(src_pool, dst_pool, runs, block_bytes)
                end.record(self._stream)
        except self._runtime.CUDARuntimeError as exc:
            return self._fall_back(exc)._copy_runs(src_pool, dst_pool, runs, block_bytes)
        return TransferHandle.pending(run_bytes(runs, block_bytes), start, end)

    def _fall_back(self, exc: BaseException) -> StagedTransfer:
        logger.warning("cupy-p2p %s -> %s failed (%s); copying KV blocks through pinned host memory from now on",
                       self._src, self._dst, _describe(exc))
        # NOTE: the staged copy waits on the current stream, so it lands after any peer copy already queued
        torch.cuda.current_stream(self._src).wait_stream(self._stream)
        self._fallback = StagedTransfer(self._src, self._dst)
        return self._fallback

    def _memcpy_runs(self, src_pool, dst_pool, runs, stride: int) -> None:
        src_ptr, dst_ptr = src_pool.data_ptr(), dst_pool.data_ptr()     # stride: a block's bytes, both pools
        for src, dst, length in runs:
            self._runtime.memcpyPeerAsync(
                dst_ptr + dst * stride, self._dst.index,
                src_ptr + src * stride, self._src.index,
                length * stride, self._stream.cuda_stream,
            )

    def _check_pools(self, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
        if src_pool.device != self._src or dst_pool.device != self._dst:
            raise ValueError(
                f"pools on {src_pool.device} -> {dst_pool.device}, backend built for {self._src} -> {self._dst}"
            )
        if not (src_pool.is_contiguous() and dst_pool.is_contiguous()):
            raise ValueError("cupy-p2p needs contiguous pools")


def make_cupy_p2p(src: torch.device, dst: torch.device) -> CupyP2PTransfer:
    """Check CuPy, CUDA and peer access, enable peer access both ways where possible, build the backend.

    Raises TransferUnavailable saying why when any of them is missing (PeerAccessUnavailable when
    only peer access is).
    """
    if src.type != "cuda" or dst.type != "cuda":
        raise TransferUnavailable(f"cupy-p2p needs two different CUDA devices, got {src} and {dst}")
    runtime = import_cupy_runtime()
    try:
        src, dst = _resolve(runtime, src), _resolve(runtime, dst)
        _check_peers(runtime, src, dst)
        enable_peer_access(runtime, src.index, dst.index)
        if runtime.deviceCanAccessPeer(dst.index, src.index):
            enable_peer_access(runtime, dst.index, src.index)
    except runtime.CUDARuntimeError as exc:
        raise TransferUnavailable(f"cupy is installed but CUDA is unusable: {_describe(exc)}") from exc
    return CupyP2PTransfer(runtime, src, dst)


def import_cupy_runtime():
    """`cupy.cuda.runtime` once a runtime call works; TransferUnavailable otherwise."""
    try:
        from cupy.cuda import runtime
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        raise TransferUnavailable(f"cupy is not importable: {_describe(exc)}") from exc
    try:
        runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        raise TransferUnavailable(f"cupy is installed but CUDA is unusable: {_describe(exc)}") from exc
    return runtime


def enable_peer_access(runtime, device: int, peer: int) -> None:
    """Let `device` access `peer`'s memory; an already enabled pair is fine."""
    previous = runtime.getDevice()
    runtime.setDevice(device)
    try:
        runtime.deviceEnablePeerAccess(peer)
    except runtime.CUDARuntimeError as exc:
        # NOTE: cupy-cuda12x links cudart statically, so this stale "last error" never reaches torch's.
        if exc.status != PEER_ACCESS_ALREADY_ENABLED:
            reason = f"cannot enable peer access cuda:{device} -> cuda:{peer}: {_describe(exc)}"
            raise PeerAccessUnavailable(reason) from exc
    finally:
        runtime.setDevice(previous)


def _resolve(runtime, device: torch.device) -> torch.device:
    index = runtime.getDevice() if device.index is None else device.index
    count = runtime.getDeviceCount()
    if index >= count:
        raise TransferUnavailable(f"{device} does not exist: CUDA sees {count} device(s)")
    return torch.device("cuda", index)


def _check_peers(runtime, src: torch.device, dst: torch.device) -> None:
    if src == dst:
        raise TransferUnavailable(f"cupy-p2p needs two different CUDA devices, got {src} and {dst}")
    if not runtime.deviceCanAccessPeer(src.index, dst.index):
        raise PeerAccessUnavailable(f"devices {src} and {dst} cannot access each other as peers")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
