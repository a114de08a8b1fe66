"""Choosing the KV transfer backend for a pair of devices."""
from __future__ import annotations

import logging

import torch

from pdserve.engine.transfer.base import KVTransfer, TransferUnavailable
from pdserve.engine.transfer.cupy_p2p import PeerAccessUnavailable, make_cupy_p2p
from pdserve.engine.transfer.staged import make_staged
from pdserve.engine.transfer.torch_copy import TorchTransfer

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "cupy-p2p", "staged")


def select_transfer(
    src_device: torch.device, dst_device: torch.device, forced: str | None = None
) -> KVTransfer:
    """Pick the KV transfer backend for copies from `src_device` to `dst_device`.

    Without `forced`, between two CUDA devices: "cupy-p2p" when CuPy, CUDA and peer access all work;
    "staged" (through pinned host memory, with a warning) when the devices are not peers; else "torch".
    Forced "cupy-p2p" also falls back to "staged" without peer access. Raises ValueError for an
    unknown `forced` name and TransferUnavailable (with the reason) when the forced backend cannot work.
    """
    src, dst = torch.device(src_device), torch.device(dst_device)
    if forced is not None and forced not in BACKEND_NAMES:
        raise ValueError(f"unknown KV transfer backend {forced!r}; valid: {', '.join(BACKEND_NAMES)}")
    if forced == "torch" or (forced is None and not _two_cuda_devices(src, dst)):
        return TorchTransfer()
    if forced == "staged":
        return make_staged(src, dst)
    try:
        return make_cupy_p2p(src, dst)
    except PeerAccessUnavailable as exc:
        return _staged_instead(src, dst, exc)
    except TransferUnavailable as exc:
        if forced == "cupy-p2p":
            raise
        if not _peers(src, dst):
            return _staged_instead(src, dst, exc)
        logger.info("KV transfer %s -> %s falls back to torch: %s", src, dst, exc)
        return TorchTransfer()


def _staged_instead(src: torch.device, dst: torch.device, reason: Exception) -> KVTransfer:
    logger.warning("KV transfer %s -> %s: %s; copying through pinned host memory (staged) instead",
                   src, dst, reason)
    return make_staged(src, dst)


def _two_cuda_devices(src: torch.device, dst: torch.device) -> bool:
    return src.type == "cuda" and dst.type == "cuda" and src != dst


def _peers(src: torch.device, dst: torch.device) -> bool:
    """Whether CUDA reports peer access src -> dst (True when it cannot be asked: torch decides then)."""
    try:
        return torch.cuda.can_device_access_peer(src, dst)
    except (RuntimeError, AssertionError, ValueError):
        return True
