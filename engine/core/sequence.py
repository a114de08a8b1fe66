"""The mutable state of one request while an actor owns it."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core.messages import FinishReason, PromptLogprobs, Request
from pdserve.engine.core.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class Sequence:
    """One request on one actor.

    `num_computed_tokens` counts positions whose KV has been *scheduled* into this actor's pool
    (it advances when a step is scheduled, not when it finishes); `num_in_flight` counts tokens
    sampled by scheduled steps whose results have not been recorded yet. With one step in
    flight at a time both settle before the next schedule; with overlap the scheduler plans
    the next step on top of them.
    """

    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1             # its recurrent layers' state slot in the pool (-1: the model has none)
    aborted: bool = False
    row: int = -1                    # the model runner's row for this sequence, -1 when it has none
    synced_blocks: int = 0           # how much of `block_table` the runner's row holds
    num_in_flight: int = 0
    last_step: int = -1              # id of the newest step that scheduled it
    done: bool = False               # left this actor (finished, aborted, failed, preempted)
    block_hashes: list[bytes] = field(default_factory=list)   # of its full blocks (prefix caching)
    num_registered_blocks: int = 0   # of its blocks registered in the prefix cache
    num_cached_tokens: int = 0       # prompt tokens found in the prefix cache (or a KV tier) at admission
    loading: bool = False            # blocks of its prefix are being loaded from a KV tier: not scheduled yet
    drafts: tuple[int, ...] = ()     # draft tokens of the verification in flight (speculative decoding)
    spec: object = None              # the speculator's state for this sequence (engine.core.speculative)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)   # of its chunks so far, if it asked

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill computes prompt logprobs: it asked, and its first token has not gone out (they
        went with it: a sequence prefilled again after preemption does not send them twice)."""
        return self.request.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host: the prompt and the recorded output."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def planned_tokens(self) -> int:
        """Tokens once the steps in flight are recorded."""
        return self.num_tokens + self.num_in_flight

    def token_slice(self, start: int, stop: int) -> list[int]:
        prompt = self.request.prompt_token_ids
        if stop <= len(prompt):
            return list(prompt[start:stop])
        head = list(prompt[start:]) if start < len(prompt) else []
        return head + self.output_token_ids[max(start - len(prompt), 0):stop - len(prompt)]

    def can_continue(self, max_model_len: int) -> bool:
        """Whether one more token may be planned on top of those in flight (max_tokens, context window)."""
        return (len(self.output_token_ids) + self.num_in_flight < self.params.max_tokens
                and self.planned_tokens < max_model_len)

    def finish_reason(self, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """Why generation ends after the newest output token, or None to go on."""
        params, last = self.params, self.output_token_ids[-1]
        produced = len(self.output_token_ids)
        if produced >= params.min_tokens:
            if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
                return FinishReason.STOP
        if produced >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
