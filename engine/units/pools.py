"""The one pool-sizing rule: what share of its device's KV budget each unit takes, and the most blocks it can
use. Each builder measures the budget its own way (`PoolSizer` profiles a loaded model, worker processes
read the memory free before they load, a simulated accelerator its datasheet) and applies these."""
from __future__ import annotations

import torch

PREFILL_SHARE_OF_SHARED_DEVICE = 0.25   # a device's KV budget for its prefill units next to units that decode:
#                                         their cap (PREFILL_POOL_PROMPTS prompts) bounds what they take; deriving
#                                         the share needs the sizer to hand the others what prefill cannot use
PREFILL_POOL_PROMPTS = 4                # a prefill unit holds the prompts of its step and of the copies still
#                                         landing: a few of the longest prompts, not a decode batch's worth


def pool_shares(roles: list[tuple[str, torch.device]], blocks_per_seq: int,
                max_num_seqs: int) -> list[tuple[float, int]]:
    """Per unit (its role and device): its share of its device's budget and its cap in blocks. The units on one
    device split its budget: a quarter for its prefill units next to units that decode, evenly within a role."""
    shares = [(0.0, 0)] * len(roles)
    for device in dict.fromkeys(d for _, d in roles):
        here = [i for i, (_, d) in enumerate(roles) if d == device]
        prefills = [i for i in here if roles[i][0] == "prefill"]
        others = [i for i in here if roles[i][0] != "prefill"]
        prefill_share = PREFILL_SHARE_OF_SHARED_DEVICE if prefills and others else 1.0
        for i in here:
            if roles[i][0] == "prefill":
                shares[i] = (prefill_share / len(prefills), blocks_per_seq * PREFILL_POOL_PROMPTS)
            else:
                rest = 1.0 - (prefill_share if prefills else 0.0)
                shares[i] = (rest / len(others), blocks_per_seq * max_num_seqs)
    return shares


def blocks_within(budget_bytes: float, share: float, cap: int, block_bytes: int) -> int:
    """A unit's blocks from its device's budget: its share, at most its cap."""
    return min(int(budget_bytes * share) // block_bytes, cap)
