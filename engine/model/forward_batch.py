"""The one object that carries attention metadata into the model (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RecurrentStates:
    """The recurrent layers' states a step reads and updates: each sequence's slot, and per layer every slot's."""

    slots: torch.Tensor                    # [S] int64, each sequence's slot, in the batch's sequence order
    conv: tuple[torch.Tensor, ...]         # per recurrent layer: [slots, conv_dim, kernel - 1] float32
    recurrent: tuple[torch.Tensor, ...]    # per recurrent layer: [slots, v_heads, k_head_dim, v_head_dim] float32


@dataclass(frozen=True, slots=True)
class WindowKV:
    """Where a `split_window` model's sliding layers keep their K and V this step: their own pool, tables, slots."""

    pool: torch.Tensor                     # [window slots, layers, 2, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor             # [S, max_blocks] int32: each block's window slot
    slot_mapping: torch.Tensor             # [T] int64, -1 skips the store


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Tensors describing one model step over a packed batch of S sequences and T tokens.

    `cu_seqlens_q is None` marks a decode step: exactly one new token per sequence.
    """

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, -1 skips the store (padding)
    block_tables: torch.Tensor     # [S, max_blocks] int32
    context_lens: torch.Tensor     # [S] int32, tokens of context including this step's
    cu_seqlens_q: torch.Tensor | None  # [S + 1] int32; None for decode
    logits_indices: torch.Tensor   # [S'] int64, rows of the hidden states to sample from
    state: RecurrentStates | None = None   # the sequences' state slots (a model with recurrent layers)
    window: WindowKV | None = None         # the sliding layers' K and V apart (a model run with window slots)

    @property
    def is_decode(self) -> bool:
        return self.cu_seqlens_q is None
