"""What every actor does with a finished step: end the rows whose own data failed, register the blocks it filled
in the prefix cache, append each sequence's tokens (and verified drafts, and prompt logprobs), and let a finished
sequence go."""
from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

from pdserve.engine.core.batch import Batch
from pdserve.engine.core.messages import FinishReason, PromptLogprobs, StepOutput
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.worker.step_runner import StepOutcome

logger = logging.getLogger(__name__)

Recorded = list[tuple[Sequence, FinishReason | None]]


class Recording:
    """Mixed into the Actor: these read and write its blocks, runner rows, speculator and emit."""

    def end_faulted(self, batch: Batch, faults: tuple[tuple[int, str], ...]) -> None:
        """End each sequence whose own data failed (its runner row's in this finished step, or its drafts'): its
        request gets an error and its blocks go; the unit serves on."""
        failed = self.speculator.take_faulty() if self.speculator is not None else []
        if faults:
            by_row = dict(faults)
            failed += [(seq, by_row[seq.row]) for seq in batch.sequences() if seq.row in by_row]
        for seq, why in failed:
            if not seq.done:
                logger.warning("%s: request %s failed alone: %s", self.unit_name, seq.request_id, why)
                self.emit(StepOutput((seq.request_id,), (-1,), (FinishReason.ERROR,), error=f"request failed: {why}"))
                self.drop(seq)

    def cache_landed(self, batch: Batch) -> None:
        """Register in the prefix cache the blocks this finished step filled (their KV now exists)."""
        if not self.blocks.enable_caching:
            return
        size = self.blocks.block_size
        for seq, landed in batch.landed():
            full = landed // size
            if not seq.done and full > seq.num_registered_blocks:
                hashes = extend_hashes(seq, full * size, size)[:full]     # NOTE: admission may have hashed more
                self.blocks.register(seq.request_id, hashes, seq.num_registered_blocks)
                seq.num_registered_blocks = full

    def release_behind_window(self, batch: Batch) -> None:
        """Give back the blocks this finished step's sequences will never read again (a KV window's)."""
        if self.blocks.releases_behind and sum(self.blocks.release_behind(seq.request_id, landed)
                                         for seq, landed in batch.landed() if not seq.done):
            self.blocks_released()

    def record_prompt_logprobs(self, batch: Batch, outcome: StepOutcome) -> dict[str, PromptLogprobs]:
        """Each asking chunk's prompt logprobs join its sequence's; those of the sequences whose last chunk this
        step ran, whole, by request id (they go out with the first token)."""
        whole = {}
        for index, part in outcome.result.prompt_logprobs:
            chunk = batch.chunks[index]
            seq = chunk.seq
            if seq.done:                           # left while the step ran
                continue
            seq.prompt_logprobs.append(part)
            if chunk.sample:
                whole[seq.request_id] = PromptLogprobs.join(seq.prompt_logprobs)
        return whole

    def record_tokens(self, seqs: Seq[Sequence], outcome: StepOutcome,
                      prompt_logprobs: dict[str, PromptLogprobs]) -> tuple[StepOutput, Recorded]:
        """Append each live sequence's sampled token; the output to publish (with `record_prompt_logprobs`'s whole
        prompt logprobs) and who finished why."""
        ids, tokens, reasons, logprobs, cached, recorded = [], [], [], [], [], []
        result = outcome.result
        eos, limit, all_logprobs = self.unit.eos_token_ids, self.max_model_len, result.logprobs
        for i, seq in enumerate(seqs):
            if seq.done:                           # left while the step ran: its token is dropped
                continue
            token = result.token_ids[i]
            seq.num_in_flight -= 1
            seq.output_token_ids.append(token)
            reason = seq.finish_reason(eos, limit)
            ids.append(seq.request_id)
            tokens.append(token)
            reasons.append(reason)
            logprobs.append(all_logprobs[i] if all_logprobs else None)
            cached.append(seq.num_cached_tokens)
            recorded.append((seq, reason))
        output = StepOutput(tuple(ids), tuple(tokens), tuple(reasons), tuple(logprobs) if all_logprobs else None,
                            cached_tokens=tuple(cached) if any(cached) else None,
                            prompt_logprobs=tuple([prompt_logprobs.get(i) for i in ids]) if prompt_logprobs else None)
        return output, recorded

    def record_verified(self, batch: Batch, outcome: StepOutcome, output: StepOutput,
                        recorded: Recorded) -> tuple[StepOutput, Recorded]:
        """Append each verifying sequence's kept drafts and next token, up to where it finishes."""
        ids, tokens, reasons = list(output.request_ids), list(output.token_ids), list(output.finish_reasons)
        logprobs = list(output.logprobs or (None,) * len(output))
        eos, limit, result = self.unit.eos_token_ids, self.max_model_len, outcome.result
        for seq, emitted, row_logprobs in zip(batch.verify, result.verified,
                                              result.verified_logprobs or (None,) * len(batch.verify)):
            if seq.done:                           # left while the step ran: its tokens are dropped
                continue
            seq.num_in_flight -= 1
            self.speculator.accept(seq, self.blocks, len(emitted) - 1)
            for j, token in enumerate(emitted):
                seq.output_token_ids.append(token)
                reason = seq.finish_reason(eos, limit)
                ids.append(seq.request_id)
                tokens.append(token)
                reasons.append(reason)
                logprobs.append(row_logprobs[j] if row_logprobs else None)
                if reason is not None:
                    break
            recorded.append((seq, reason))
        more = len(ids) - len(output)
        cached = output.cached_tokens and output.cached_tokens + (0,) * more
        prompt = output.prompt_logprobs and output.prompt_logprobs + (None,) * more
        return StepOutput(tuple(ids), tuple(tokens), tuple(reasons), tuple(logprobs) if any(logprobs) else None,
                          cached_tokens=cached, prompt_logprobs=prompt), recorded

    def leave(self, seq: Sequence) -> None:
        """`seq` is done on this actor: its runner row goes, its blocks are freed (once no step holds them)."""
        seq.done = True
        self.rows.release_row(seq)
        if seq.last_step > self.completed_step:
            self.blocks.free_after(seq.request_id, seq.last_step)
        else:
            self.blocks.free(seq.request_id)
