"""Choosing the KV transfer backend for a pair of devices."""
from __future__ import annotations

import logging

import torch

from engine.transfer.base import KVTransfer, TransferUnavailable
from engine.transfer.torch_copy import TorchTransfer

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "cupy-p2p")


def select_transfer(
    src_device: torch.device, dst_device: torch.device, forced: str | None = None
) -> KVTransfer:
    """Pick the KV transfer backend for copies from `src_device` to `dst_device`.

    Without `forced`: "cupy-p2p" between two CUDA devices when CuPy, CUDA and peer access all
    work, else "torch". Raises ValueError for an unknown `forced` name and TransferUnavailable
    (with the reason) when the forced backend cannot work here.
    """
    src, dst = torch.device(src_device), torch.device(dst_device)
    if forced is not None and forced not in BACKEND_NAMES:
        raise ValueError(f"unknown KV transfer backend {forced!r}; valid: {', '.join(BACKEND_NAMES)}")
    if forced == "torch" or (forced is None and not _two_cuda_devices(src, dst)):
        return TorchTransfer()
    from engine.transfer.cupy_p2p import make_cupy_p2p

    if forced == "cupy-p2p":
        return make_cupy_p2p(src, dst)
    try:
        return make_cupy_p2p(src, dst)
    except TransferUnavailable as exc:
        logger.info("KV transfer %s -> %s falls back to torch: %s", src, dst, exc)
        return TorchTransfer()


def _two_cuda_devices(src: torch.device, dst: torch.device) -> bool:
    return src.type == "cuda" and dst.type == "cuda" and src != dst
