"""Everything that crosses an actor boundary: frozen, slotted dataclasses."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.engine.core.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or the context window
    ABORT = "abort"        # client went away, engine.abort(), shutdown
    ERROR = "error"        # the engine failed this request


@dataclass(frozen=True, slots=True)
class Request:
    """A tokenized prompt and how to continue it. Higher `priority` runs first."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None      # requests with different salts never share cached KV blocks


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log-probabilities of consecutive prompt tokens, each under the raw logits (float32, before penalties,
    temperature and masks) of the position before it: the token's logprob, its rank in the vocabulary
    (1: the likeliest) and the top alternatives there. A whole prompt's start at its second token (the first
    has no position before it)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()   # per token: (token_id, logprob), best first

    @classmethod
    def join(cls, parts: list[PromptLogprobs]) -> PromptLogprobs:
        """The parts (consecutive runs of one prompt, in order) as one."""
        if len(parts) == 1:
            return parts[0]
        return cls(tuple(t for p in parts for t in p.token_ids), tuple(x for p in parts for x in p.logprobs),
                   tuple(r for p in parts for r in p.ranks), tuple(t for p in parts for t in p.top))


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One actor step's sampled tokens, handed to the engine front at once (actor -> engine front).

    Entry i: request `request_ids[i]` got `token_ids[i]` and, if `finish_reasons[i]` is set,
    ends there. FinishReason.ERROR entries carry token -1 and `error` says why.
    """

    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    finish_reasons: tuple[FinishReason | None, ...]
    logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: str | None = None
    cached_tokens: tuple[int, ...] | None = None     # prompt tokens found in the prefix cache; None: all 0
    prompt_logprobs: tuple[PromptLogprobs | None, ...] | None = None   # with a request's first token, if asked

    def __len__(self) -> int:
        return len(self.request_ids)


class TokenEvent(NamedTuple):
    """What `Engine.submit` yields: new tokens and their text, or the end.

    `text` is the new text since the previous event (stop strings already cut
    off, never a broken UTF-8 character). The last event of a stream has
    `finish_reason` set; `error` explains FinishReason.ERROR. The event of the first token carries
    the prompt's logprobs when the request asked for them (`SamplingParams.prompt_logprobs`).

    NOTE: a NamedTuple, not a frozen dataclass: one is built per token per request on the
    event loop, and a NamedTuple is much cheaper to construct (bench/RESULTS.md, "Measured once").
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """Prefill -> decode: a sequence whose KV is being copied into its reserved decode blocks.

    The decode actor admits it once every handle in `transfers` reports done.
    """

    request: Request
    num_computed_tokens: int
    output_token_ids: tuple[int, ...]
    transfers: tuple = ()          # engine.transfer.base.TransferHandle, one per started copy
    block_hashes: tuple[bytes, ...] = ()   # prefix-cache hashes of its full blocks
    num_cached_tokens: int = 0     # prompt tokens the prefill actor found in its prefix cache
    decode_unit: int = 0           # the decode unit holding its reservation


@dataclass(frozen=True, slots=True)
class Reservation:
    """Decode blocks reserved on decode unit `unit` for a sequence being prefilled elsewhere;
    the first `num_cached` of them were cached there (not copied). `evicted`: the (block, hash) of registered
    blocks it took from that pool's cache, for the prefill unit to save to the KV tiers before copying into them."""

    blocks: tuple[int, ...]
    num_cached: int
    unit: int = 0
    evicted: tuple[tuple[int, bytes], ...] = ()
    state_blocks: tuple[int, ...] = ()      # its state slot's blocks there (a model with recurrent layers)
    window_blocks: tuple[tuple[int, ...], ...] = ()   # per block, its window slot's blocks there (none: no slot)


@dataclass(frozen=True, slots=True)
class Release:
    """Prefill -> coordinator: give back a reservation on `decode_unit` that was never handed off."""

    request_id: str
    decode_unit: int


@dataclass(frozen=True, slots=True)
class Preempted:
    """Decode -> coordinator -> a prefill unit: a sequence whose decode blocks were taken back; prefill it again."""

    request: Request
    output_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ActorStats:
    name: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int
    last_step_time: float      # time.monotonic() at the end of the newest step; 0.0 before the first
    alive: bool = True
    prefix_cache_queries: int = 0   # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0      # of which found there
    role: str = ""                  # what its compute does now: prefill, decode, colocated, lent, idle
    lent_steps: int = 0             # steps run with cores borrowed from the other actor
    local_prefills: int = 0         # prompts this actor placed on itself (adaptive mode)
    remote_prefills: int = 0        # and on the prefill actor
    spec_drafts: int = 0            # speculative decoding (vLLM's meaning): verifications run,
    spec_draft_tokens: int = 0      # draft tokens verified,
    spec_accepted_tokens: int = 0   # of which accepted,
    spec_accepted_per_position: tuple[int, ...] = ()   # accepted at draft position 0, 1, ..; () when off
    unit: str = ""                  # the unit it steps on: prefill, decode1, colocated0, ...
    routed_prefill: int = 0         # prompts the coordinator routed to this unit (to prefill)
    routed_decode: int = 0          # prefilled sequences it routed here (decode blocks reserved)
    retired: bool = False           # its unit failed and could not be restarted: it serves no more
    kv_verify_mismatches: int = 0   # its hand-off copies that --kv-verify found different at the two ends


@dataclass(frozen=True, slots=True)
class EngineStats:
    actors: tuple[ActorStats, ...]
    running: int               # sequences being decoded (or in colocated mode, prefilled or decoded)
    waiting: int               # requests not yet producing tokens: queued or being prefilled
    num_unfinished: int = 0    # every request whose stream has not ended
    restarts: int = 0          # times the supervisor rebuilt the actors after a failure
    dead: bool = False         # the supervisor gave up: the server is exiting
    tiers: tuple = ()          # engine.core.kv_tiers.TierStats of each KV tier, fastest first
