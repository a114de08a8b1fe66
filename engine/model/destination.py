"""Where one checkpoint tensor goes in the model: a parameter, or a slice, rows or expert of one."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Destination:
    param: str
    start: int | None = None            # row range inside a fused parameter
    stop: int | None = None
    rows: torch.Tensor | None = None    # the checkpoint rows (along rows_dim), in the order the model stores them
    offset: float = 0.0                 # added to every value (Gemma's norms scale by 1 + weight)
    expert: int | None = None           # one expert of a stacked [experts, ...] parameter
    transposed: bool = False            # the checkpoint stores the matrix as [in, out] (gpt-oss's experts)
    rows_dim: int = 0
