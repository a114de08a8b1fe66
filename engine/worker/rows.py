"""The runner's persistent per-row state, and filling a step's inputs from it without Python per token.

A row holds one sequence's token ids (as they were when the row was created), its block table
(updated only when blocks are appended) and its last sampled token (on the device: a decode
row's next input, known before the host has seen it).
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.transfer.host_copy import upload
from pdserve.engine.worker.input_buffers import InputBuffers
from pdserve.engine.worker.step import StepInput


class RowState:
    def __init__(self, max_blocks: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.device = device
        self.block_tables = np.zeros((0, max_blocks), dtype=np.int32)
        self.tokens: list[np.ndarray | None] = []
        self.joins = np.zeros(0, dtype=np.int64)       # how often each row was given to a new sequence
        self.state_slots = np.zeros(0, dtype=np.int64)  # each row's recurrent state slot (-1: none)
        self.last_token = torch.zeros(0, dtype=torch.int32, device=device)

    @property
    def capacity(self) -> int:
        return len(self.tokens)

    def apply(self, step: StepInput) -> None:
        """Free, add and extend rows as the step says, before it runs."""
        for row in step.freed_rows:
            self.tokens[row] = None
        if step.new_rows:
            self._ensure(max(new.row for new in step.new_rows) + 1)
            for new in step.new_rows:
                self.tokens[new.row] = np.asarray(new.token_ids, dtype=np.int32)
                self.block_tables[new.row] = 0                 # NOTE: a reused row keeps no stale entries
                self._write_blocks(new.row, 0, new.block_ids)
                self.state_slots[new.row] = new.state_slot
            rows = np.array([new.row for new in step.new_rows], dtype=np.int64)
            self.joins[rows] += 1
            last = np.array([new.token_ids[-1] for new in step.new_rows], dtype=np.int32)
            self.last_token[upload(rows, self.device)] = upload(last, self.device)
        for append in step.appends:
            self._write_blocks(append.row, append.first, append.block_ids)

    def _write_blocks(self, row: int, first: int, block_ids) -> None:
        if first + len(block_ids) > self.max_blocks:
            raise ValueError(f"row {row}: {first + len(block_ids)} blocks exceed the table width {self.max_blocks}")
        self.block_tables[row, first:first + len(block_ids)] = np.maximum(np.asarray(block_ids, np.int32), 0)
        #                                   NOTE: NO_BLOCK (behind the KV window: never read) reads as padding does

    def _ensure(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        capacity = max(rows, 2 * self.capacity, 16)
        grown = np.zeros((capacity, self.max_blocks), dtype=np.int32)
        grown[:self.capacity] = self.block_tables
        self.block_tables = grown
        self.tokens += [None] * (capacity - self.capacity)
        self.joins = np.concatenate([self.joins, np.zeros(capacity - len(self.joins), dtype=np.int64)])
        self.state_slots = np.concatenate([self.state_slots, np.full(capacity - len(self.state_slots), -1, np.int64)])
        last = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        last[:self.last_token.shape[0]] = self.last_token
        self.last_token = last

    def remember_sampled(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """rows [S'] int32, tokens [S'] on the device: the next decode inputs of those rows."""
        self.last_token[rows.long()] = tokens.to(torch.int32)


def step_shape(step: StepInput, block_size: int) -> tuple[int, int, int]:
    """(tokens, sequences, table width in blocks) of a step."""
    positions = (list(step.decode_positions) + [c.start + c.num_tokens - 1 for c in step.chunks]
                 + [v.start + len(v.token_ids) - 1 for v in step.verify])
    longest = max(positions, default=0) + 1
    verify_seqs = len(step.verify) if step.chunks else sum(len(v.token_ids) for v in step.verify)
    return step.num_tokens, len(step.decode_rows) + len(step.chunks) + verify_seqs, -(-longest // block_size)


def num_logits(step: StepInput) -> int:
    """Logits rows of a step: one per sampled row, then one per token of each verifying row."""
    return len(step.sampled_rows) + sum(len(v.token_ids) for v in step.verify)


def fill_inputs(buffers: InputBuffers, rows: RowState, step: StepInput, block_size: int, width: int) -> None:
    """Write a step's metadata into the host side of `buffers` (vectorised over tokens and rows).

    Verifying rows, their tokens given by the step, run like chunks after the prefill chunks in a step
    with chunks, else as one decode row per token (`_fill_decode`)."""
    buffers.wait_reusable()
    if not step.chunks:
        return _fill_decode(buffers, rows, step, block_size, width)
    b = buffers.np
    num_decode, chunks, verify = len(step.decode_rows), step.chunks, step.verify
    spans = [(c.row, c.start, c.num_tokens) for c in chunks] + [(v.row, v.start, len(v.token_ids)) for v in verify]
    chunk_rows, starts, lengths = np.array(spans, dtype=np.int32).reshape(-1, 3).T
    seq_rows = np.concatenate([np.asarray(step.decode_rows, dtype=np.int32), chunk_rows])
    num_seqs, num_tokens = len(seq_rows), num_decode + int(lengths.sum())
    b["rows"][:num_seqs] = seq_rows
    positions = b["positions"][:num_tokens]
    positions[:num_decode] = step.decode_positions
    positions[num_decode:] = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    b["input_ids"][num_decode:num_tokens] = np.concatenate(
        [rows.tokens[c.row][c.start:c.start + c.num_tokens] for c in chunks]
        + [np.asarray(v.token_ids, dtype=np.int32) for v in verify])
    token_rows = np.concatenate([seq_rows[:num_decode], np.repeat(chunk_rows, lengths)])
    blocks = rows.block_tables[token_rows, positions // block_size]
    b["slots"][:num_tokens] = blocks * block_size + positions % block_size
    context = b["context_lens"][:num_seqs]
    context[:num_decode] = positions[:num_decode] + 1
    context[num_decode:] = starts + lengths
    cu = b["cu_seqlens"][:num_seqs + 1]
    cu[0] = 0
    np.cumsum(np.concatenate([np.ones(num_decode, dtype=np.int32), lengths]), out=cu[1:])
    sampling = np.fromiter((c.sample for c in chunks), dtype=bool, count=len(chunks))
    num_sampled = num_decode + int(sampling.sum())
    chunk_ends = cu[1 + num_decode:1 + num_decode + len(chunks)]
    verified = np.arange(num_tokens - int(lengths[len(chunks):].sum()), num_tokens)
    indices = np.concatenate([np.arange(num_decode), chunk_ends[sampling] - 1, verified])
    b["logits_indices"][:len(indices)] = indices
    b["sampled_rows"][:num_sampled] = np.concatenate([seq_rows[:num_decode], chunk_rows[:len(chunks)][sampling]])
    buffers.block_table_view(num_seqs, width)[:] = rows.block_tables[seq_rows, :width]


def _fill_decode(buffers: InputBuffers, rows: RowState, step: StepInput, block_size: int, width: int) -> None:
    """fill_inputs for a step without chunks: one position per row. A verifying row's tokens become rows of
    their own over its block table, each seeing the positions before it: the decode kernels store every
    row's K and V before any row attends, so within a layer this is causal attention over the drafts."""
    b, n = buffers.np, len(step.decode_rows)
    seq_rows = np.asarray(step.decode_rows, dtype=np.int32)
    positions = np.asarray(step.decode_positions, dtype=np.int32)
    if step.verify:
        lengths = [len(v.token_ids) for v in step.verify]
        seq_rows = np.concatenate([seq_rows, np.repeat(np.array([v.row for v in step.verify], np.int32), lengths)])
        positions = np.concatenate([positions, *(np.arange(v.start, v.start + len(v.token_ids), dtype=np.int32)
                                                 for v in step.verify)])
        b["input_ids"][n:len(seq_rows)] = np.concatenate([v.token_ids for v in step.verify])
    m = len(seq_rows)
    b["rows"][:m] = seq_rows
    b["sampled_rows"][:n] = seq_rows[:n]
    b["positions"][:m] = positions
    b["slots"][:m] = rows.block_tables[seq_rows, positions // block_size] * block_size + positions % block_size
    b["context_lens"][:m] = positions + 1
    counting = np.arange(m + 1, dtype=np.int32)
    b["cu_seqlens"][:m + 1] = counting
    b["logits_indices"][:m] = counting[:m]
    buffers.block_table_view(m, width)[:] = rows.block_tables[seq_rows, :width]


def gather_decode_inputs(buffers: InputBuffers, rows: RowState, num_decode: int) -> None:
    """On the device, after upload: decode rows take their last sampled token as input."""
    if num_decode:
        torch.index_select(rows.last_token, 0, buffers.dev["rows"][:num_decode],
                           out=buffers.dev["input_ids"][:num_decode])
