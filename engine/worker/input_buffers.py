"""A step's attention metadata in one int32 buffer: pinned host staging, one copy to the device.

Sections sit at fixed offsets (block tables last), so a step fills the host side with numpy,
copies `host[:end]` to the device in one non-blocking copy, and hands the model views of the
device side. On CPU the device side is the host buffer itself: nothing is copied. The host side is
filled again only once the previous step's copy out of it has run (`wait_reusable`: an event of that
earlier step, long done when its tokens have been read, never the current step's work).
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.model.forward_batch import ForwardBatch

SECTIONS = ("input_ids", "positions", "slots", "context_lens", "cu_seqlens", "logits_indices", "rows",
            "sampled_rows", "block_tables")


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.device = device
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slots": max_tokens,
                 "context_lens": max_seqs, "cu_seqlens": max_seqs + 1, "logits_indices": max_seqs,
                 "rows": max_seqs, "sampled_rows": max_seqs, "block_tables": max_seqs * max_blocks}
        self.offsets, total = {}, 0
        for name in SECTIONS:
            self.offsets[name] = (total, total + sizes[name])
            total += sizes[name]
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=on_cuda)
        self.device_buffer = torch.zeros(total, dtype=torch.int32, device=device) if on_cuda else self.host
        self.np = {name: self.host.numpy()[start:stop] for name, (start, stop) in self.offsets.items()}
        self.dev = {name: self.device_buffer[start:stop] for name, (start, stop) in self.offsets.items()}
        self._uploaded: torch.cuda.Event | None = None

    def fits(self, num_tokens: int, num_seqs: int, width: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and width <= self.max_blocks

    def upload(self, num_seqs: int, width: int) -> None:
        """Copy the filled host sections to the device: one non-blocking copy (nothing on CPU)."""
        if self.device_buffer is self.host:
            return
        end = self.offsets["block_tables"][0] + num_seqs * width
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    def wait_reusable(self) -> None:
        """Before writing the host side: wait for the last upload out of it to have run (CUDA only)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def forward_batch(self, num_tokens: int, num_seqs: int, num_sampled: int, width: int,
                      is_decode: bool) -> ForwardBatch:
        """Device views of a filled step: T tokens, S sequences, S' sampled rows, tables W wide."""
        d = self.dev
        return ForwardBatch(
            input_ids=d["input_ids"][:num_tokens], positions=d["positions"][:num_tokens],
            slot_mapping=d["slots"][:num_tokens],
            block_tables=d["block_tables"][:num_seqs * width].view(num_seqs, width),
            context_lens=d["context_lens"][:num_seqs],
            cu_seqlens_q=None if is_decode else d["cu_seqlens"][:num_seqs + 1],
            logits_indices=d["logits_indices"][:num_sampled])

    def block_table_view(self, num_seqs: int, width: int) -> np.ndarray:
        return self.np["block_tables"][:num_seqs * width].reshape(num_seqs, width)
