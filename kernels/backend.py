"""Which kernel path serves a device, checked once at start-up: `check_backend(device)`.

PDSERVE_KERNELS=torch forces the plain-torch references, =triton forces Triton (an error at start-up
when Triton cannot run there); unset, CUDA tensors use Triton and everything else the references.
"""
from __future__ import annotations

import logging

import torch

from pdserve import env
from pdserve.kernels._triton import HAS_TRITON, IMPORT_ERROR, INTERPRETED

logger = logging.getLogger(__name__)

MODES = ("", "torch", "triton")
_warned: set[str] = set()


class KernelBackendError(ValueError):
    """PDSERVE_KERNELS asks for a kernel path that cannot run here; the message says why."""


def forced_mode() -> str:
    """'' (automatic), 'torch' or 'triton'; KernelBackendError for anything else."""
    mode = env.kernels_override()
    if mode not in MODES:
        raise KernelBackendError(f"PDSERVE_KERNELS must be torch or triton (or unset), got {mode!r}")
    return mode


def triton_unusable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot serve tensors on `device`, or None when they can."""
    if not HAS_TRITON:
        return (f"Triton is not importable ({IMPORT_ERROR}); it is a dependency on Linux x86_64 and aarch64 "
                f"(triton>=3.5 there): install it for this platform")
    if device.type != "cuda" and not INTERPRETED:
        return f"Triton kernels on {device} need TRITON_INTERPRET=1 (set before start-up)"
    return None


def check_backend(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on `device`; warns once when CUDA falls back to the references.

    Raises KernelBackendError when PDSERVE_KERNELS=triton cannot be honoured on `device`."""
    device, mode = torch.device(device), forced_mode()
    reason = triton_unusable_reason(device)
    if mode == "triton":
        if reason is not None:
            raise KernelBackendError(f"PDSERVE_KERNELS=triton: {reason}")
        return "triton"
    if mode == "torch" or device.type != "cuda":
        return "torch"
    if reason is not None:
        _warn_once(f"{device}: {reason}. CUDA tensors run the plain-torch reference kernels instead, which "
                   f"read metadata back to the host in every layer (much slower)")
        return "torch"
    if INTERPRETED:
        _warn_once(f"{device}: TRITON_INTERPRET=1 is set, so the Triton kernels run in the interpreter "
                   f"on the host (much slower)")
    return "triton"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
