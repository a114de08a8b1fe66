"""The only code that owns tensors: model weights, one KV pool, the sampler, device streams."""
from __future__ import annotations

import contextlib
import time

import torch

from engine.core.batch import Batch, ScheduledChunk
from engine.core.messages import TokenLogprob
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from engine.model.llama import CausalLM
from engine.model.weights import load_weights
from engine.worker.cuda_graph import DecodeGraphs
from engine.worker.memory import kv_layout
from engine.worker.sampler import Sampler


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    """Build the model with empty parameters on `device` and fill them from the checkpoint."""
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(config, max_positions)
    load_weights(model, config.model_dir)
    return model.eval()


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, eos_token_ids: frozenset[int],
                 graph_max_batch: int = 0, max_blocks_per_seq: int = 0) -> None:
        """`graph_max_batch > 0` captures CUDA graphs for decode batches up to that size (CUDA only)."""
        c = model.config
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = eos_token_ids
        self.forward_seconds = 0.0       # model forward + logits, summed over steps
        self.kv_layout = kv_layout(c, block_size)
        self.kv_pool = self.kv_layout.allocate(num_blocks, self.dtype, self.device)
        self.sampler = Sampler(c.vocab_size, eos_token_ids)
        self.graphs = None
        if graph_max_batch and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.kv_pool, graph_max_batch, max_blocks_per_seq)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[tuple[int, TokenLogprob | None]]:
        """Run one step; returns (token, logprob) for every chunk with `sample`, in batch order."""
        forward_batch = self.prepare(batch)
        if self.device.type != "cuda":
            started = time.perf_counter()
            logits = self.forward(forward_batch)
            self.forward_seconds += time.perf_counter() - started
            return self.sampler(logits, [c.seq for c in batch.sampled]) if batch.sampled else []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self.forward(forward_batch)
        end.record()
        sampled = self.sampler(logits, [c.seq for c in batch.sampled]) if batch.sampled else []
        end.synchronize()                 # NOTE: already done once the sampler read its tokens back
        self.forward_seconds += start.elapsed_time(end) / 1e3
        return sampled

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """logits [S', V] fp32 of the rows in batch.logits_indices (a captured graph for decode)."""
        if (batch.is_decode and self.graphs is not None
                and self.graphs.fits(batch.input_ids.shape[0], batch.block_tables.shape[1])):
            return self.graphs.run(batch)
        hidden = self.model(batch, self.kv_pool)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def prepare(self, batch: Batch) -> ForwardBatch:
        input_ids, positions, slots, context_lens, cu_seqlens, logits_indices = [], [], [], [], [0], []
        for chunk in batch.chunks:
            input_ids += chunk.seq.token_slice(chunk.start, chunk.stop)
            positions += range(chunk.start, chunk.stop)
            slots += self._slots(chunk)
            context_lens.append(chunk.stop)
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
            if chunk.sample:
                logits_indices.append(cu_seqlens[-1] - 1)
        return ForwardBatch(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._block_tables(batch.chunks),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=None if batch.is_decode else self._tensor(cu_seqlens, torch.int32),
            logits_indices=self._tensor(logits_indices, torch.int64),
        )

    def _slots(self, chunk: ScheduledChunk) -> list[int]:
        table, size = chunk.seq.block_table, self.block_size
        return [table[p // size] * size + p % size for p in range(chunk.start, chunk.stop)]

    def _block_tables(self, chunks: tuple[ScheduledChunk, ...]) -> torch.Tensor:
        width = max(-(-c.stop // self.block_size) for c in chunks)
        rows = [c.seq.block_table[:width] + [0] * (width - min(len(c.seq.block_table), width))
                for c in chunks]
        return self._tensor(rows, torch.int32)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
