"""CUDA graphs for decode steps: one captured graph per batch-size bucket, sharing one memory pool."""
from __future__ import annotations

import bisect

import torch

from engine.model.forward_batch import ForwardBatch
from engine.model.llama import CausalLM


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
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(size, dtype=torch.int64, device=device)
        self.memory_pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for bucket in reversed(self.buckets):       # largest first: the others reuse its memory
            self.graphs[bucket] = self._capture(bucket)

    def _static_batch(self, n: int) -> ForwardBatch:
        return ForwardBatch(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                            self.block_tables[:n], self.context_lens[:n], None, self.logits_indices[:n])

    @torch.inference_mode()
    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(bucket)
        side = torch.cuda.Stream(self.kv_pool.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                # warm-up: compile kernels, settle allocations
            self.model.compute_logits(self.model(batch, self.kv_pool))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = self.model.compute_logits(self.model(batch, self.kv_pool))   # capture
        return graph, logits

    def fits(self, num_seqs: int, num_blocks: int) -> bool:
        return num_seqs <= self.buckets[-1] and num_blocks <= self.block_tables.shape[1]

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """logits [S, V] of a decode batch (S <= the largest bucket)."""
        n, width = batch.input_ids.shape[0], batch.block_tables.shape[1]
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.context_lens[:n].copy_(batch.context_lens)
        self.context_lens[n:bucket].zero_()
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]
