"""The mutable state of one request while an actor owns it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.messages import FinishReason, Request
from engine.core.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class Sequence:
    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0          # tokens whose KV is in this actor's pool
    block_table: list[int] = field(default_factory=list)
    aborted: bool = False

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
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        prompt = self.request.prompt_token_ids
        if stop <= len(prompt):
            return list(prompt[start:stop])
        head = list(prompt[start:]) if start < len(prompt) else []
        return head + self.output_token_ids[max(start - len(prompt), 0):stop - len(prompt)]

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
