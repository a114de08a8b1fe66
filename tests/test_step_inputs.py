"""The runner's persistent rows, updated incrementally, equal a from-scratch rebuild after random operations."""
from __future__ import annotations

import random

import numpy as np
import torch

from pdserve.engine.actors.runner_rows import RunnerRows
from pdserve.engine.core.batch import Batch, ScheduledChunk
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.worker.input_buffers import InputBuffers
from pdserve.engine.worker.rows import RowState, fill_inputs, gather_decode_inputs, step_shape

BLOCK = 4


def reference_inputs(batch: Batch) -> dict[str, list]:
    """The step's metadata written out per token in plain Python (what the runner used to rebuild)."""
    ids, positions, slots, context = [], [], [], []
    for seq in batch.decode:
        pos = seq.num_computed_tokens - 1
        ids.append(seq.token_slice(pos, pos + 1)[0])
        positions.append(pos)
        slots.append(seq.block_table[pos // BLOCK] * BLOCK + pos % BLOCK)
        context.append(pos + 1)
    for chunk in batch.chunks:
        ids += chunk.seq.token_slice(chunk.start, chunk.stop)
        positions += range(chunk.start, chunk.stop)
        slots += [chunk.seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(chunk.start, chunk.stop)]
        context.append(chunk.stop)
    seqs = batch.sequences()
    width = max(-(-c // BLOCK) for c in context)
    tables = [s.block_table[:width] + [0] * (width - min(len(s.block_table), width)) for s in seqs]
    return {"input_ids": ids, "positions": positions, "slots": slots, "context_lens": context, "tables": tables}


def test_incremental_rows_equal_a_rebuild_after_random_operations():
    rng = random.Random(0)
    blocks, planner = BlockManager(400, BLOCK), RunnerRows()
    rows, buffers = RowState(max_blocks=64, device=torch.device("cpu")), InputBuffers(512, 64, 64, torch.device("cpu"))
    live: list[Sequence] = []
    for step_index in range(120):
        for _ in range(rng.randrange(3)):                              # sequences join
            prompt = tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 20)))
            seq = Sequence(Request(f"s{step_index}-{len(live)}", prompt))
            seq.block_table = blocks.grow(seq.request_id, seq.num_tokens + 1)
            live.append(seq)
        for seq in [s for s in live if rng.random() < 0.1]:           # and leave
            live.remove(seq)
            planner.release_row(seq)
            blocks.free(seq.request_id)
        decode, chunks = [], []
        for seq in live:
            if seq.num_computed_tokens < seq.num_tokens - 1:           # prefill the rest in one or two chunks
                size = min(seq.num_tokens - seq.num_computed_tokens, rng.randrange(1, 12))
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, size,
                                             seq.num_computed_tokens + size == seq.num_tokens))
                seq.num_computed_tokens += size
            else:
                seq.num_computed_tokens = seq.num_tokens
                decode.append(seq)
        if not decode and not chunks:
            continue
        batch = Batch(tuple(decode), tuple(chunks))
        step = planner.step_input(batch)
        rows.apply(step)
        num_tokens, num_seqs, width = step_shape(step, BLOCK)
        fill_inputs(buffers, rows, step, BLOCK, width)
        gather_decode_inputs(buffers, rows, len(step.decode_rows))
        expected = reference_inputs(batch)
        b = buffers.np
        assert b["input_ids"][:num_tokens].tolist() == expected["input_ids"]
        assert b["positions"][:num_tokens].tolist() == expected["positions"]
        assert b["slots"][:num_tokens].tolist() == expected["slots"]
        assert b["context_lens"][:num_seqs].tolist() == expected["context_lens"]
        assert buffers.block_table_view(num_seqs, width).tolist() == expected["tables"]
        for seq in live:                                               # the persistent tables themselves
            if seq.row >= 0:
                assert rows.block_tables[seq.row, :len(seq.block_table)].tolist() == seq.block_table
        sampled = [s for s in batch.sampled]
        new_tokens = [rng.randrange(1000) for _ in sampled]
        rows.remember_sampled(torch.tensor([s.row for s in sampled], dtype=torch.int32), torch.tensor(new_tokens))
        for seq, token in zip(sampled, new_tokens):                    # the host learns them, then grows tables
            seq.output_token_ids.append(token)
            seq.block_table = blocks.grow(seq.request_id, seq.num_tokens + 1)
    blocks.check_consistency()


def test_cu_seqlens_and_sampled_rows_of_a_mixed_step():
    blocks, planner = BlockManager(50, BLOCK), RunnerRows()
    rows, buffers = RowState(16, torch.device("cpu")), InputBuffers(64, 8, 16, torch.device("cpu"))
    seqs = [Sequence(Request(str(i), tuple(range(10 + i)))) for i in range(3)]
    for seq in seqs:
        seq.block_table = blocks.grow(seq.request_id, seq.num_tokens + 1)
    seqs[0].num_computed_tokens = seqs[0].num_tokens
    batch = Batch((seqs[0],), (ScheduledChunk(seqs[1], 0, 5, False), ScheduledChunk(seqs[2], 0, 12, True)))
    step = planner.step_input(batch)
    rows.apply(step)
    fill_inputs(buffers, rows, step, BLOCK, step_shape(step, BLOCK)[2])
    b = buffers.np
    assert b["cu_seqlens"][:4].tolist() == [0, 1, 6, 18]
    assert b["logits_indices"][:2].tolist() == [0, 17]
    assert b["sampled_rows"][:2].tolist() == [seqs[0].row, seqs[2].row]
    assert np.array_equal(b["rows"][:3], [s.row for s in seqs])
