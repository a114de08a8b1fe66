"""Routing with KV tiers: a prompt's blocks found in a tier are loaded, not prefilled, on whichever unit takes it,
so a returning conversation whose history left its unit's pool goes to the least loaded unit; measured, a tier
hit costs its copy-in time."""
from __future__ import annotations

import dataclasses

from pdserve.engine.coordinator.routing import PrefillView, first_token_order
from pdserve.engine.core.messages import Request
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.engine import Engine
from tests.models import SLOS_SET, demo_checkpoint, engine_config
from tests.test_engine_modes import prompts

BLOCK = 16


def test_tier_hits_count_as_not_computed_and_in_seconds_at_their_copy_in_price():
    holder = PrefillView(0, 100, 40, None)                     # its pool holds 160 of 200 tokens
    idle = PrefillView(1, 0, 200, None)
    assert first_token_order([holder, idle]) == [0, 1]          # 140 vs 200 tokens
    holder_t = dataclasses.replace(holder, uncached_tokens=8, tier_tokens=32)
    idle_t = dataclasses.replace(idle, uncached_tokens=8, tier_tokens=192)   # the tiers hold the rest
    assert first_token_order([holder_t, idle_t]) == [1, 0]      # 108 vs 8 tokens
    timed = [dataclasses.replace(v, seconds_per_token=1e-3) for v in (holder_t, idle_t)]
    assert first_token_order(timed, tier_seconds_per_token=1e-5) == [1, 0]   # 0.108 s vs 0.0099 s
    assert first_token_order(timed, tier_seconds_per_token=1e-3) == [0, 1]   # copies as slow as prefill


def test_a_returning_turn_whose_history_is_in_the_tiers_goes_to_the_idle_unit(tmp_path):
    config = engine_config(demo_checkpoint(), mode="colocated", prefill_device="cpu,cpu", **SLOS_SET)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_offload_memory=1 << 20))
    engine = Engine(config)
    busy, idle = engine.coordinator.decode
    history = Sequence(Request("turn-2", prompts([200], seed=9)[0]))
    hashes = extend_hashes(history, 200, BLOCK)
    busy.blocks.grow("turn-1", 160)
    busy.blocks.register("turn-1", hashes[:10])                 # the busy unit's pool holds 160 tokens of it
    busy.blocks.free("turn-1")
    tier = engine.units.tiers.index.tiers[0]
    for digest in hashes:                                       # the tier holds all of it (evicted, read back)
        tier.commit(tier.reserve(digest))
    busy.send(Request("queued", prompts([100], seed=1)[0], SamplingParams(max_tokens=4)))
    assert busy.uncached_tokens(history) == idle.uncached_tokens(history) == 200 - 12 * BLOCK
    assert (busy.tier_tokens(history), idle.tier_tokens(history)) == (2 * BLOCK, 12 * BLOCK)
    assert engine.coordinator.first_token_unit(engine.coordinator.decode, history) == 1
    engine.units.tiers.index.tiers[0].check_consistency()
    engine.close()
