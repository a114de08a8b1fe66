"""The only code that owns tensors: model weights, one KV pool, per-row state, the sampler, device streams."""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from pdserve import kernels
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch, RecurrentStates
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.quant import load_weights_quantized
from pdserve.engine.worker.sampling.constraints import RowConstraints
from pdserve.engine.worker.cuda_graph import DecodeGraphs
from pdserve.engine.transfer.host_copy import ReadBack, upload
from pdserve.engine.worker.input_buffers import InputBuffers
from pdserve.engine.worker.memory import kv_layout
from pdserve.engine.worker.pending_step import PendingStep, StepTimer
from pdserve.engine.worker.prompt_logprobs import score_prompts
from pdserve.engine.worker.rows import RowState, fill_inputs, gather_decode_inputs, num_logits, step_shape
from pdserve.engine.worker.sampling.sampler import Sampler, read_back_into
from pdserve.engine.worker.sampling.sampling_table import SamplingTable
from pdserve.engine.worker.state_pool import StatePool, carve_state_slots
from pdserve.engine.worker.window_pool import WindowPool, carve_window_slots, window_layout
from pdserve.engine.worker.spec_verify import read_back_into as verified_into, verify_on_device, with_logprobs
from pdserve.engine.worker.step import NewRow, StepInput, StepResult

FAULTED = SamplingParams(max_tokens=1, temperature=0.0)    # what a row whose own parameters failed samples with


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str = "none", threads: int = 1) -> CausalLM:
    """Build the model with empty parameters on `device` and fill them from the checkpoint, quantized by
    `quantization` (engine.model.quant; its start-up probes run with `threads`)."""
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(config, max_positions)
    load_weights_quantized(model, quantization, threads)
    return model.eval()


class ModelRunner:
    """Runs StepInputs on one device against one KV pool, keeping per-row state between steps."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, eos_token_ids: frozenset[int],
                 graph_max_batch: int = 0, max_blocks_per_seq: int = 0, buffer_tokens: int = 256,
                 buffer_seqs: int = 32, kv_pool: torch.Tensor | None = None, state_slots: int = 0,
                 window_seqs: int = 0) -> None:
        """`graph_max_batch > 0` captures CUDA graphs for decode batches up to that size (CUDA only).

        `buffer_tokens` and `buffer_seqs` size the step buffers (they grow if a step needs more); `kv_pool`
        is a pool allocated elsewhere (shared memory), else one is allocated here. A model with recurrent layers
        keeps `state_slots` sequences' states at the end of the pool (`state_pool`): `num_blocks` then counts
        the KV blocks before them. A `split_window` model given `window_seqs` keeps its sliding layers' K and V
        apart, in window slots for that many sequences at the end of the pool (`window_pool`)."""
        c = model.config
        self.model = model
        model.use_backend(kernels.choose_backend(model.embed_tokens.weight))    # NOTE: once, not per op
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = eos_token_ids
        self.kv_window = c.kv_window
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        self.forward_seconds = 0.0       # device work of a step (forward, logits, sampling), summed
        split = bool(window_seqs and c.split_window)
        self.kv_layout = kv_layout(c, block_size, split)
        self.kv_pool = self.kv_layout.allocate(num_blocks, self.dtype, self.device) if kv_pool is None else kv_pool
        self.state_slots = carve_state_slots(c, self.kv_layout, self.dtype, num_blocks, state_slots)
        self.state = None if self.state_slots is None else StatePool(c, self.kv_pool, self.state_slots)
        if self.state_slots is not None:
            self.num_blocks = self.state_slots.first_block
        self.window_slots = carve_window_slots(c, block_size, num_blocks, window_seqs,
                                               self.max_blocks_per_seq) if split else None
        self.window = None if self.window_slots is None else WindowPool(self.kv_pool, self.window_slots,
                                                                        window_layout(c, block_size))
        if self.window_slots is not None:
            self.num_blocks = self.window_slots.first_block
        self.rows = RowState(self.max_blocks_per_seq, self.device)
        self.sampling = SamplingTable(c.vocab_size, eos_token_ids, self.device)
        self.sampler = Sampler(c.vocab_size, eos_token_ids)
        self.constraints = RowConstraints(c.model_dir, c.vocab_size, eos_token_ids)
        self.mask_seconds = 0.0          # host time of the newest step's token masks (0 without any)
        self.faults: list[tuple[int, str]] = []     # rows of the step being launched whose own data failed
        self.buffers = InputBuffers(buffer_tokens, buffer_seqs, self.max_blocks_per_seq, self.device)
        self._unsettled: deque[PendingStep] = deque()   # launched, their host bookkeeping not done yet
        self.graphs = None
        if graph_max_batch and self.device.type == "cuda" and self.window is None:
            self.graphs = DecodeGraphs(model, self.kv_pool, graph_max_batch, self.max_blocks_per_seq)

    def execute(self, step: StepInput) -> StepResult:
        """Apply the step's row changes, run it, and sample; one token per sampled row, in order (waits for them)."""
        result = self.launch(step).result()
        self.settle()
        return result

    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """`execute` without waiting: the step is queued on the device and its tokens are on their way to
        pinned host memory; `PendingStep.result()` waits for them. Nothing here waits for the device, but
        while this runner has grammar rows it first waits for the steps before (their tokens advance the
        matchers that fill this step's masks)."""
        if self.constraints.matchers or self.constraints.pending:
            for earlier in self._unsettled:
                earlier.result()
        self.settle()
        self.faults = []
        self.apply(step)
        if not step.num_tokens:
            return PendingStep(step, faults=tuple(self.faults))
        timer, readback, self.mask_seconds = StepTimer(self.device), ReadBack(self.device), 0.0
        sampled_rows = step.sampled_rows
        masks = self.constraints.start(sampled_rows)      # filled while the forward runs
        logits, buffers, hidden = self._forward(step)
        num_sampled = len(sampled_rows)
        sampled = self._sample(logits[:num_sampled], buffers, step, masks, readback) if num_sampled else None
        verified = self._verify(logits[num_sampled:], step, readback) if step.verify else None
        prompt = score_prompts(self.model, hidden, self.rows, step, readback) if step.chunks else None
        timer.stop()
        readback.start()
        pending = PendingStep(step, readback, timer, sampled, verified, self._joins(step, sampled_rows),
                              tuple(self.faults), prompt)
        self._unsettled.append(pending)
        return pending

    def _joins(self, step: StepInput, sampled_rows: tuple[int, ...]) -> np.ndarray | None:
        """RowState.joins of the sampled, then the verifying rows, where `settle` will need them (grammar rows
        to advance, verified rows to count); None when it has nothing to do but add up device time."""
        if not (self.constraints.matchers or self.constraints.pending or step.verify):
            return None
        return self.rows.joins[np.array(sampled_rows + tuple(v.row for v in step.verify), dtype=np.int64)]

    def settle(self) -> None:
        """The host bookkeeping of launched steps whose tokens were read, oldest first: grammar matchers
        advance, verified rows count their outputs, device time adds up. Rows given to another sequence
        since a step launched are skipped (the new sequence has its own state)."""
        while self._unsettled and self._unsettled[0].ready:
            pending = self._unsettled.popleft()
            result, step = pending.result(), pending.step
            self.forward_seconds += pending.seconds
            if pending.joins is None:
                continue
            rows = np.array(step.sampled_rows + tuple(v.row for v in step.verify), dtype=np.int64)
            live = self.rows.joins[rows] == pending.joins
            sampled, verify = live[:len(step.sampled_rows)], live[len(step.sampled_rows):]
            self.constraints.advance([r for r, ok in zip(step.sampled_rows, sampled) if ok],
                                     [t for t, ok in zip(result.token_ids, sampled) if ok])
            if step.verify:
                self.sampling.settle_emitted(rows[len(step.sampled_rows):][verify],
                                             [len(t) for t, ok in zip(result.verified, verify) if ok])

    def _sample(self, logits: torch.Tensor, buffers: InputBuffers, step: StepInput, masks, readback: ReadBack):
        sampled_rows = np.asarray(step.sampled_rows, dtype=np.int64)
        device_rows = buffers.dev["sampled_rows"][:len(sampled_rows)]
        batch = self.sampling.batch(sampled_rows, device_rows=device_rows)
        constraints = None
        if masks is not None:
            built = masks.result()
            self.faults += built.faults
            constraints = built.to(self.device)
        output = self.sampler.sample(logits, batch, constraints)
        self.rows.remember_sampled(device_rows, output.tokens)
        self.sampling.record(sampled_rows, output.tokens)
        self.mask_seconds = constraints.mask_seconds if constraints is not None else 0.0
        return read_back_into(readback, output), batch

    def _verify(self, logits: torch.Tensor, step: StepInput, readback: ReadBack):
        """Kept drafts and one more token per verifying row, and their logprobs where asked; the rows'
        sampling state and last token follow on the device."""
        verified = verify_on_device(self.sampler, self.sampling, logits, step.verify)
        verified = with_logprobs(verified, logits, self.sampling, step.verify)
        rows = np.array([v.row for v in step.verify], dtype=np.int64)
        self.sampling.record_emitted(rows, verified.emitted, verified.kept + 1)
        final = verified.emitted.gather(1, verified.kept.unsqueeze(1)).squeeze(1)
        self.rows.remember_sampled(upload(rows, self.device), final)
        return verified_into(readback, verified), verified

    def apply(self, step: StepInput) -> None:
        """Free, add and extend rows as `step` says (execute does this first)."""
        for row in step.freed_rows:
            self.sampling.free(row)
            self.constraints.free(row)
        self.rows.apply(step)
        if self.window is not None:
            self.window.assign(step.window_slots)
        for new in step.new_rows:
            self._admit(new)

    def _admit(self, new: NewRow) -> None:
        """A new row's sampling parameters and constraints. A row whose own parameters fail here samples greedily
        instead (the step keeps its shape) and is reported in the step's faults: it fails that request, not the unit."""
        prompt, outputs = new.token_ids[:new.num_prompt_tokens], new.token_ids[new.num_prompt_tokens:]
        try:
            self.sampling.add(new.row, new.params, prompt, outputs)
            self.constraints.add(new.row, new.params, outputs)
        except Exception as e:                     # NOTE: whatever a row's parameters cause, it ends that row only
            self.constraints.free(new.row)
            self.sampling.add(new.row, FAULTED, (), ())
            self.faults.append((new.row, f"{type(e).__name__}: {e}"))

    def prepare(self, step: StepInput) -> ForwardBatch:
        """The model's inputs for an applied `step` (eager buffers; every token's hidden state is computed)."""
        num_tokens, num_seqs, width = step_shape(step, self.block_size)
        buffers = self._buffers_for(num_tokens, max(num_seqs, num_logits(step)), width)
        fill_inputs(buffers, self.rows, step, self.block_size, width)
        buffers.upload(num_seqs, width)
        gather_decode_inputs(buffers, self.rows, len(step.decode_rows))
        batch = buffers.forward_batch(num_tokens, num_seqs, num_logits(step), width, is_decode=not step.chunks)
        if self.window is not None:
            batch = replace(batch, window=self.window.for_step(batch))
        return batch if self.state is None else replace(batch, state=self._states(step, buffers, num_seqs))

    def _states(self, step: StepInput, buffers: InputBuffers, num_seqs: int) -> RecurrentStates:
        """The step's sequences' state slots; those starting their first chunk are zeroed first."""
        fresh = [self.rows.state_slots[c.row] for c in step.chunks if c.start == 0]
        if fresh:
            self.state.reset(upload(np.asarray(fresh, dtype=np.int64), self.device))
        slots = self.rows.state_slots[buffers.np["rows"][:num_seqs]]
        return self.state.for_step(upload(slots, self.device))

    def logits(self, step: StepInput) -> torch.Tensor:
        """logits [S', V] fp32 of an applied step's sampled rows (a captured graph for decode when one fits)."""
        return self._forward(step)[0]

    def _forward(self, step: StepInput) -> tuple[torch.Tensor, InputBuffers, torch.Tensor | None]:
        """(logits of the sampled rows, the step's buffers, every token's final hidden state; None from a graph)."""
        decode_only = not step.chunks and not step.verify
        if decode_only and self.graphs is not None and self.graphs.fits(*step_shape(step, self.block_size)[1:]):
            return self.graphs.run(self.rows, step), self.graphs.buffers, None
        batch = self.prepare(step)
        logits = self.model.decode_logits(batch, self.kv_pool) if decode_only else None
        if logits is not None:
            return logits, self.buffers, None
        hidden = self.model(batch, self.kv_pool)
        return self.model.compute_logits(hidden[batch.logits_indices]), self.buffers, hidden

    def _buffers_for(self, num_tokens: int, num_seqs: int, width: int) -> InputBuffers:
        b = self.buffers
        if not b.fits(num_tokens, num_seqs, width):
            self.buffers = InputBuffers(max(num_tokens, 2 * b.max_tokens), max(num_seqs, 2 * b.max_seqs),
                                        max(width, b.max_blocks), self.device)
        return self.buffers
