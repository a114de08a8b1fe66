"""Which unit: the earliest predicted first token for a prompt, KV room and the least step growth for a
prefilled sequence. Pure functions over what the coordinator reads off the units: deterministic for a
given state, ties broken by unit index.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillView:
    """One unit that can prefill a prompt, as routing sees it."""

    index: int
    queued_tokens: int               # prompt tokens queued there (its mailbox and its steps in flight included)
    uncached_tokens: int             # the prompt's tokens it would compute: its prefix-cache hits are free
    seconds_per_token: float | None  # its measured prefill rate (the step cost model); None: unmeasured
    up: bool = True                  # False while the unit fails or restarts: skipped
    tier_tokens: int = 0             # the prompt's tokens it would load from a KV tier (past its cache hits)


@dataclass(frozen=True, slots=True)
class DecodeView:
    """One decode unit, as routing sees it for a prefilled sequence."""

    index: int
    rows_after: int                  # sequences holding blocks there (reserved, landing, decoding), plus this one
    seconds_after: float | None      # its predicted step time then (the step cost model); None: unmeasured
    cached_blocks: int = 0           # the sequence's prefix already cached there: not copied
    up: bool = True


def first_token_order(units: Sequence[PrefillView], tier_seconds_per_token: float | None = None) -> list[int]:
    """Live units, soonest predicted first token first: queued plus uncached tokens, in seconds when every
    live unit's rate is measured, else in tokens (the same scale for all). Tokens loaded from a KV tier cost
    their measured copy-in time (`tier_seconds_per_token`) in seconds; in tokens, or before any load was
    measured, nothing (as cached ones: the tiers are the same for every unit)."""
    live = [u for u in units if u.up]
    timed = all(u.seconds_per_token is not None for u in live)
    tier_price = tier_seconds_per_token if timed and tier_seconds_per_token is not None else 0.0

    def wait(u: PrefillView) -> tuple[float, int]:
        tokens = u.queued_tokens + u.uncached_tokens
        if not timed:
            return float(tokens), u.index
        return tokens * u.seconds_per_token + u.tier_tokens * tier_price, u.index

    return [u.index for u in sorted(live, key=wait)]


def decode_order(units: Sequence[DecodeView]) -> list[int]:
    """Live decode units, least predicted step time after adding the sequence first (seconds when every
    live unit's cost is measured, else rows), then the most cached prefix; the coordinator tries them in
    this order and takes the first with room in its KV pool."""
    live = [u for u in units if u.up]
    timed = all(u.seconds_after is not None for u in live)

    def growth(u: DecodeView) -> tuple[float, int, int]:
        return (u.seconds_after if timed else float(u.rows_after)), -u.cached_blocks, u.index

    return [u.index for u in sorted(live, key=growth)]
