"""Turning a scheduled Batch into the runner's StepInput: row numbers, new rows, appended blocks."""
from __future__ import annotations

from pdserve.engine.core.batch import Batch, ScheduledChunk
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.worker.step import BlockAppend, ChunkInput, NewRow, StepInput, VerifyInput


def _chunk_input(chunk: ScheduledChunk) -> ChunkInput:
    seq = chunk.seq
    return ChunkInput(seq.row, chunk.start, chunk.num_tokens, chunk.sample,
                      seq.params.prompt_logprobs if seq.scores_prompt else None)


class RunnerRows:
    """Owns one runner's row numbers; tells the runner only what changed since the last step.

    A row freed here is reported in the next StepInput, which the runner applies before that
    step's new rows, so a row number can be handed out again at once.
    """

    def __init__(self) -> None:
        self._free_rows: list[int] = []
        self._num_rows = 0
        self._freed: list[int] = []

    def step_input(self, batch: Batch, window_slots: tuple[tuple[int, int], ...] = ()) -> StepInput:
        new_rows, appends = [], []
        for seq in batch.sequences():
            if seq.row < 0:
                new_rows.append(self._new_row(seq))
            elif len(seq.block_table) > seq.synced_blocks:
                appends.append(BlockAppend(seq.row, seq.synced_blocks, tuple(seq.block_table[seq.synced_blocks:])))
                seq.synced_blocks = len(seq.block_table)
        freed, self._freed = tuple(self._freed), []
        decode = batch.decode
        verify = tuple(VerifyInput(s.row, p, (s.output_token_ids[-1], *d))     # NOTE: nothing of s is in flight
                       for s, p, d in zip(batch.verify, batch.verify_positions, batch.verify_drafts))
        return StepInput(freed, tuple(new_rows), tuple(appends), tuple([s.row for s in decode]),
                         batch.decode_positions or tuple([s.num_computed_tokens - 1 for s in decode]),
                         tuple(_chunk_input(c) for c in batch.chunks), verify, window_slots)

    def _new_row(self, seq: Sequence) -> NewRow:
        seq.row = self._free_rows.pop() if self._free_rows else self._take_new_row()
        seq.synced_blocks = len(seq.block_table)
        tokens = tuple(seq.prompt_token_ids) + tuple(seq.output_token_ids)
        return NewRow(seq.row, tokens, len(seq.prompt_token_ids), tuple(seq.block_table), seq.params, seq.state_slot)

    def _take_new_row(self) -> int:
        self._num_rows += 1
        return self._num_rows - 1

    def release_row(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self._freed.append(seq.row)
            self._free_rows.append(seq.row)
            seq.row = -1

    @property
    def rows_in_use(self) -> int:
        return self._num_rows - len(self._free_rows)
