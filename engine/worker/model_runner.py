"""The only code that owns tensors: model weights, one KV pool, per-row state, the sampler, device streams."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from pdserve import kernels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.weights import load_weights
from pdserve.engine.worker.sampling.constraints import RowConstraints
from pdserve.engine.worker.cuda_graph import DecodeGraphs
from pdserve.engine.worker.input_buffers import InputBuffers
from pdserve.engine.worker.memory import kv_layout
from pdserve.engine.worker.rows import RowState, fill_inputs, gather_decode_inputs, num_logits, step_shape
from pdserve.engine.worker.sampling.sampler import Sampler, read_back
from pdserve.engine.worker.sampling.sampling_table import SamplingTable
from pdserve.engine.worker.spec_verify import emitted_logprobs, verify
from pdserve.engine.worker.step import StepInput, StepResult


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
    """Runs StepInputs on one device against one KV pool, keeping per-row state between steps."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, eos_token_ids: frozenset[int],
                 graph_max_batch: int = 0, max_blocks_per_seq: int = 0, max_tokens: int = 256,
                 max_seqs: int = 32, kv_pool: torch.Tensor | None = None) -> None:
        """`graph_max_batch > 0` captures CUDA graphs for decode batches up to that size (CUDA only).

        `max_tokens` and `max_seqs` size the step buffers (they grow if a step needs more); `kv_pool`
        is a pool allocated elsewhere (shared memory), else one is allocated here."""
        c = model.config
        self.model = model
        model.use_backend(kernels.choose_backend(model.embed_tokens.weight))    # NOTE: once, not per op
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = eos_token_ids
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        self.forward_seconds = 0.0       # device work of a step (forward, logits, sampling), summed
        self.kv_layout = kv_layout(c, block_size)
        self.kv_pool = self.kv_layout.allocate(num_blocks, self.dtype, self.device) if kv_pool is None else kv_pool
        self.rows = RowState(self.max_blocks_per_seq, self.device)
        self.sampling = SamplingTable(c.vocab_size, eos_token_ids, self.device)
        self.sampler = Sampler(c.vocab_size, eos_token_ids)
        self.constraints = RowConstraints(c.model_dir, c.vocab_size, eos_token_ids)
        self.mask_seconds = 0.0          # host time of the newest step's token masks (0 without any)
        self.buffers = InputBuffers(max_tokens, max_seqs, self.max_blocks_per_seq, self.device)
        self.graphs = None
        if graph_max_batch and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.kv_pool, graph_max_batch, self.max_blocks_per_seq)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepResult:
        """Apply the step's row changes, run it, and sample; one token per sampled row, in order."""
        self.apply(step)
        if not step.num_tokens:
            return StepResult()
        started, self.mask_seconds = self._clock(), 0.0
        masks = self.constraints.start(step.sampled_rows)      # filled while the forward runs
        logits, buffers = self._logits(step)
        num_sampled = len(step.sampled_rows)
        tokens, logprobs = self._sample(logits[:num_sampled], buffers, step, masks) if num_sampled else ((), None)
        verified, verified_logprobs = self._verify(logits[num_sampled:], step) if step.verify else ((), None)
        self._add_forward_time(started)
        return StepResult(tokens, logprobs, verified, verified_logprobs)

    def _sample(self, logits: torch.Tensor, buffers: InputBuffers, step: StepInput, masks):
        sampled_rows = np.asarray(step.sampled_rows, dtype=np.int64)
        batch = self.sampling.batch(sampled_rows)
        constraints = masks.result().to(self.device) if masks is not None else None
        output = self.sampler.sample(logits, batch, constraints)
        self.rows.remember_sampled(buffers.dev["sampled_rows"][:len(sampled_rows)], output.tokens)
        self.sampling.record(sampled_rows, output.tokens)
        tokens, logprobs = read_back(output, batch)
        self.constraints.advance(step.sampled_rows, tokens)
        self.mask_seconds = constraints.mask_seconds if constraints is not None else 0.0
        return tokens, logprobs

    def _verify(self, logits: torch.Tensor, step: StepInput):
        """Kept drafts and one more token per verifying row, and their logprobs where asked; the rows'
        sampling state and last token follow."""
        verified = verify(self.sampler, self.sampling, logits, step.verify)
        logprobs = emitted_logprobs(logits, self.sampling, step.verify, verified)
        rows = np.array([v.row for v in step.verify], dtype=np.int64)
        for column in range(max(len(tokens) for tokens in verified)):
            emitted = [i for i, tokens in enumerate(verified) if len(tokens) > column]
            tokens = torch.tensor([verified[i][column] for i in emitted], device=self.device)
            self.sampling.record(rows[emitted], tokens)
        self.rows.remember_sampled(torch.from_numpy(rows).to(self.device),
                                   torch.tensor([tokens[-1] for tokens in verified], device=self.device))
        return verified, logprobs

    def apply(self, step: StepInput) -> None:
        """Free, add and extend rows as `step` says (execute does this first)."""
        for row in step.freed_rows:
            self.sampling.free(row)
            self.constraints.free(row)
        self.rows.apply(step)
        for new in step.new_rows:
            self.sampling.add(new.row, new.params, new.token_ids[:new.num_prompt_tokens],
                              new.token_ids[new.num_prompt_tokens:])
            self.constraints.add(new.row, new.params, new.token_ids[new.num_prompt_tokens:])

    def prepare(self, step: StepInput) -> ForwardBatch:
        """The model's inputs for an applied `step` (eager buffers; every token's hidden state is computed)."""
        num_tokens, num_seqs, width = step_shape(step, self.block_size)
        buffers = self._buffers_for(num_tokens, max(num_seqs, num_logits(step)), width)
        fill_inputs(buffers, self.rows, step, self.block_size, width)
        buffers.upload(num_seqs, width)
        gather_decode_inputs(buffers, self.rows, len(step.decode_rows))
        return buffers.forward_batch(num_tokens, num_seqs, num_logits(step), width, is_decode=not step.chunks)

    def logits(self, step: StepInput) -> torch.Tensor:
        """logits [S', V] fp32 of an applied step's sampled rows (a captured graph for decode when one fits)."""
        return self._logits(step)[0]

    def _logits(self, step: StepInput) -> tuple[torch.Tensor, InputBuffers]:
        decode_only = not step.chunks and not step.verify
        if decode_only and self.graphs is not None and self.graphs.fits(*step_shape(step, self.block_size)[1:]):
            return self.graphs.run(self.rows, step), self.graphs.buffers
        batch = self.prepare(step)
        hidden = self.model(batch, self.kv_pool)
        return self.model.compute_logits(hidden[batch.logits_indices]), self.buffers

    def _buffers_for(self, num_tokens: int, num_seqs: int, width: int) -> InputBuffers:
        b = self.buffers
        if not b.fits(num_tokens, num_seqs, width):
            self.buffers = InputBuffers(max(num_tokens, 2 * b.max_tokens), max(num_seqs, 2 * b.max_seqs),
                                        max(width, b.max_blocks), self.device)
        return self.buffers

    def _clock(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _add_forward_time(self, started) -> None:
        if self.device.type != "cuda":
            self.forward_seconds += time.perf_counter() - started
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()                 # NOTE: already done once the sampler's tokens were read back
        self.forward_seconds += started.elapsed_time(end) / 1e3
