"""One object per serving mode (colocated, disaggregated, adaptive), chosen once at start-up."""
from __future__ import annotations

import os

import torch

from pdserve.engine.modes.adaptive.mode import Adaptive
from pdserve.engine.modes.base import Mode
from pdserve.engine.modes.colocated import Colocated
from pdserve.engine.modes.disaggregated import Disaggregated

MODES = {mode.name: mode for mode in (Adaptive, Disaggregated, Colocated)}


def choose_mode(name: str | None, prefill: torch.device, decode: torch.device) -> Mode:
    """The mode named, else adaptive wherever there are two compute units (two devices, or two CPU cores) and
    colocated on one CPU core. Raises ValueError for an unknown name."""
    if name is None:
        one_core = prefill.type == decode.type == "cpu" and len(os.sched_getaffinity(0)) < 2
        name = "colocated" if one_core else "adaptive"
    if name not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {name!r}")
    return MODES[name]()
