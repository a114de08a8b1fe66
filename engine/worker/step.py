"""What an actor sends its model runner for one step, and what comes back: compact, row-indexed.

A runner keeps per-row state (token ids, block table, sampling parameters, the last sampled
token) across steps, so a step message carries only what changed: rows that appear or leave,
blocks appended to a row's table, and which rows compute which positions this step. A decode
row's input token is the row's last sampled token, which the runner already holds (on the
device), so the next step can be scheduled before this one's tokens reach the host.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.core.kv_tiers import TierCopy
from pdserve.engine.core.messages import PromptLogprobs, TokenLogprob
from pdserve.engine.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRow:
    row: int
    token_ids: tuple[int, ...]       # prompt, then the output known so far
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    params: SamplingParams
    state_slot: int = -1             # its recurrent layers' state slot (-1: the model has none)


@dataclass(frozen=True, slots=True)
class BlockAppend:
    row: int
    first: int                       # index in the row's table of the first new block
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """Tokens start .. start + num_tokens - 1 of a row, from its token ids (a prefill chunk).

    With `prompt_logprobs` set, each of its positions whose next token the row holds scores that token
    (its logprob, rank and that many top alternatives: `engine.worker.prompt_logprobs`)."""

    row: int
    start: int
    num_tokens: int
    sample: bool
    prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class VerifyInput:
    """A decode row verifying drafts: `token_ids` (its last token, then the drafts) at positions start ..;
    logits come back for every one of them (speculative decoding)."""

    row: int
    start: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepInput:
    """Applied in order: free rows, add rows, append blocks; then run decode rows and chunks."""

    freed_rows: tuple[int, ...] = ()
    new_rows: tuple[NewRow, ...] = ()
    appends: tuple[BlockAppend, ...] = ()
    decode_rows: tuple[int, ...] = ()
    decode_positions: tuple[int, ...] = ()     # position each decode row computes
    chunks: tuple[ChunkInput, ...] = ()
    verify: tuple[VerifyInput, ...] = ()      # after the chunks in the model's batch
    window_slots: tuple[tuple[int, int], ...] = ()   # (block, window slot) given out since the last step

    @property
    def num_tokens(self) -> int:
        return (len(self.decode_rows) + sum(c.num_tokens for c in self.chunks)
                + sum(len(v.token_ids) for v in self.verify))

    @property
    def sampled_rows(self) -> tuple[int, ...]:
        return self.decode_rows + tuple(c.row for c in self.chunks if c.sample)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """After the step: copy these blocks of the runner's pool into the peer pool (a KV hand-off)."""

    key: str                         # whose blocks (a request id): the copy's handle comes back under it
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    peer: int = 0                    # which peer pool (decode unit) of the step runner's


@dataclass(frozen=True, slots=True)
class StepWork:
    """Everything one step does on its compute unit: blocks saved to and loaded from the KV tiers, the step,
    then the KV copies it completes."""

    step: StepInput
    copies: tuple[BlockCopy, ...] = ()
    threads: int | None = None       # CPU threads to run with (None: keep the unit's own setting)
    tier_saves: tuple[TierCopy, ...] = ()   # before the step's forward: blocks leaving a pool, written down
    tier_loads: tuple[TierCopy, ...] = ()   # then blocks read back into the pool


@dataclass(frozen=True, slots=True)
class StepResult:
    """One token per sampled row, in `StepInput.sampled_rows` order; logprobs where a row asked."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] | None = None
    verified: tuple[tuple[int, ...], ...] = ()    # per StepInput.verify row: the accepted drafts, then one more
    verified_logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] | None = None   # of each, where a row asked
    faults: tuple[tuple[int, str], ...] = ()      # (row, why): rows whose own parameters failed; their tokens are void
    prompt_logprobs: tuple[tuple[int, PromptLogprobs], ...] = ()   # (index in StepInput.chunks, scores) per asking
