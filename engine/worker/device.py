"""The one home for "make this device current": everything that creates CUDA streams, events, graphs or
launches kernels for an actor does it inside `on_device(actor's device)`.

NOTE: actors are built on a loader thread whose current CUDA device is cuda:0. Streams, events and
CUDA-graph capture streams created without an explicit device, and every Triton launch (Triton
launches on the current device's current stream), land on the current device, not on the device
of the tensors involved.
"""
from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA device; a no-op context for any other device."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def with_index(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:N` (N the current device), so that equal devices compare equal; others unchanged."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def side_stream(device: torch.device):
    """A new stream on `device` made current inside the returned context (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))
