"""CUDA graphs for decode steps: one captured graph per batch-size bucket, sharing one memory pool.

The graphs read their inputs from one InputBuffers of their own (the largest bucket, full table
width), so a replay needs one host-to-device copy and no copies between device buffers. Capture
runs on the pool's own device and on a stream created there (`on_device`): the graphs are built
on the loader thread, whose current device may be another GPU.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from pdserve.engine.model.llama import CausalLM
from pdserve.engine.worker.device import on_device
from pdserve.engine.worker.input_buffers import InputBuffers
from pdserve.engine.worker.rows import RowState, fill_inputs, gather_decode_inputs
from pdserve.engine.worker.step import StepInput
from pdserve.kernels.kv_layout import KVLayout


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to (and covering) max_batch."""
    candidates = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    return [b for b in candidates if b < max_batch] + [next(b for b in candidates if b >= max_batch)]


class DecodeGraphs:
    """Replays a captured decode step; a batch is padded to the next bucket with slot -1 and context 0."""

    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, max_batch: int, max_blocks_per_seq: int) -> None:
        device = kv_pool.device
        self.model, self.kv_pool = model, kv_pool
        self.buckets = batch_buckets(max_batch)
        size = self.buckets[-1]
        self.width = max_blocks_per_seq
        self.block_size = KVLayout.of(kv_pool).block_size
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        with on_device(device):
            self.buffers = InputBuffers(size, size, max_blocks_per_seq, device)
            self._pad(0, size)
            self.buffers.np["logits_indices"][:size] = np.arange(size)
            self.buffers.upload(size, self.width)
            self.memory_pool = torch.cuda.graph_pool_handle()
            self.capture_stream = torch.cuda.Stream(device)
            for bucket in reversed(self.buckets):       # largest first: the others reuse its memory
                self.graphs[bucket] = self._capture(bucket)

    def _pad(self, start: int, stop: int) -> None:
        b = self.buffers.np
        for name in ("input_ids", "positions", "context_lens", "rows"):
            b[name][start:stop] = 0
        b["slots"][start:stop] = -1
        self.buffers.block_table_view(stop, self.width)[start:] = 0

    @torch.inference_mode()
    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # NOTE: called inside on_device(pool device); every stream here is that device's
        batch = self.buffers.forward_batch(bucket, bucket, bucket, self.width, is_decode=True)
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):              # warm-up: compile kernels, settle allocations
            self.model.compute_logits(self.model(batch, self.kv_pool))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream):
            logits = self.model.compute_logits(self.model(batch, self.kv_pool))   # capture
        torch.cuda.current_stream().wait_stream(stream)
        return graph, logits

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1] and width <= self.width

    @torch.inference_mode()
    def run(self, rows: RowState, step: StepInput) -> torch.Tensor:
        """logits [S, V] of a decode step (S <= the largest bucket)."""
        n = len(step.decode_rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        fill_inputs(self.buffers, rows, step, self.block_size, self.width)
        self.buffers.np["logits_indices"][:n] = np.arange(n)
        self._pad(n, bucket)
        self.buffers.upload(bucket, self.width)
        gather_decode_inputs(self.buffers, rows, bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]
