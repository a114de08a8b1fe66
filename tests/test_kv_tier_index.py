"""The KV tiers' bookkeeping in plain integers: one tier's slots (LRU, pins, pending writes, bad blocks), the
store's lookups and write-through, and an actor's plan of saves and loads over a block manager."""
from __future__ import annotations

import hashlib
import random

import pytest

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.kv_tiers import KVTiers
from pdserve.engine.core.messages import Request
from pdserve.engine.core.prefix_cache import extend_hashes
from pdserve.engine.core.scheduler import PrefillScheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.tier_index import TierIndex
from pdserve.engine.core.tier_plan import TierPlan

BLOCK = 16


def digest(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def written(tier: TierIndex, *numbers: int) -> list[int]:
    slots = [tier.reserve(digest(n)) for n in numbers]
    for slot in slots:
        tier.commit(slot)
    return slots


# --- one tier -------------------------------------------------------------------------------------

def test_a_full_tier_evicts_its_least_recently_used_block_and_never_grows():
    tier = TierIndex("host", 3)
    written(tier, 1, 2, 3)
    tier.touch(digest(1))                                  # 2 is now the oldest
    written(tier, 4)
    assert tier.find(digest(2)) is None and tier.find(digest(1)) is not None
    assert len(tier) == 3 and tier.evictions == 1 and tier.blocks_in == 4
    tier.check_consistency()


def test_a_pinned_block_is_never_evicted_and_a_tier_of_pins_takes_no_write():
    tier = TierIndex("host", 2)
    first, second = written(tier, 1, 2)
    tier.pin(first)
    tier.pin(second)
    assert tier.reserve(digest(3)) is None                 # every slot is being read
    tier.unpin(second, read=True)
    slot = tier.reserve(digest(3))
    assert slot == second and tier.find(digest(1)) == first
    tier.commit(slot)
    tier.unpin(first, read=True)
    assert tier.hits == 2
    tier.check_consistency()


def test_a_pending_write_is_not_readable_and_an_abandoned_one_frees_its_slot():
    tier = TierIndex("disk", 2)
    slot = tier.reserve(digest(1))
    assert tier.find(digest(1)) is None and tier.holds(digest(1))
    tier.abandon(slot)
    assert not tier.holds(digest(1)) and len(tier) == 0
    written(tier, 5, 6)
    assert len(tier) == 2
    tier.check_consistency()


def test_a_bad_block_is_dropped_and_its_slot_reused_only_after_its_last_load():
    tier = TierIndex("disk", 1)
    (slot,) = written(tier, 1)
    tier.pin(slot)
    tier.drop(slot)
    assert tier.find(digest(1)) is None and tier.bad_blocks == 1
    assert tier.reserve(digest(2)) is None                 # still being read by the failed load
    tier.unpin(slot, read=False)
    assert tier.reserve(digest(2)) == slot
    tier.check_consistency()


def test_restore_keeps_the_order_and_ignores_slots_out_of_range():
    tier = TierIndex("disk", 3)
    tier.restore([(2, digest(1)), (0, digest(2)), (7, digest(3)), (1, digest(2))])
    assert len(tier) == 2 and tier.find(digest(1)) == 2 and tier.find(digest(2)) == 0
    written(tier, 9, 10)                                   # the free slot, then the oldest restored one
    assert tier.find(digest(1)) is None and tier.find(digest(2)) == 0
    tier.check_consistency()


def test_random_use_keeps_every_slot_counted_once():
    rng = random.Random(3)
    tier = TierIndex("host", 8)
    pending, pinned = [], []
    for _ in range(3000):
        action = rng.random()
        if action < 0.35:
            slot = tier.reserve(digest(rng.randrange(30)))
            if slot is not None:
                pending.append(slot)
        elif action < 0.55 and pending:
            slot = pending.pop(rng.randrange(len(pending)))
            tier.commit(slot) if rng.random() < 0.8 else tier.abandon(slot)
        elif action < 0.7:
            slot = tier.find(digest(rng.randrange(30)))
            if slot is not None:
                tier.pin(slot)
                pinned.append(slot)
        elif action < 0.85 and pinned:
            slot = pinned.pop(rng.randrange(len(pinned)))
            if rng.random() < 0.1:
                tier.drop(slot)
            tier.unpin(slot, read=rng.random() < 0.5)
        tier.check_consistency()
        assert len(tier) + tier.num_pending <= tier.num_slots


# --- the store -------------------------------------------------------------------------------------

def test_lookup_takes_the_fastest_tier_holding_each_block_up_to_the_first_miss():
    host, disk = TierIndex("host", 4), TierIndex("disk", 4)
    tiers = KVTiers([host, disk], BLOCK, 1024)
    written(disk, 1, 2, 3, 5)
    written(host, 2)
    assert [t for t, _ in tiers.lookup([digest(n) for n in (1, 2, 3, 4, 5)])] == [1, 0, 1]


def test_an_evicted_block_is_written_through_to_every_tier_that_lacks_it():
    host, disk = TierIndex("host", 4), TierIndex("disk", 4)
    tiers = KVTiers([host, disk], BLOCK, 1024)
    written(disk, 1)
    saves = tiers.plan_saves([(7, digest(1)), (8, digest(2))])
    assert sorted((s.block, s.tier) for s in saves) == [(7, 0), (8, 0), (8, 1)]
    assert tiers.plan_saves([(9, digest(2))]) == []        # already being written everywhere


# --- an actor's plan -------------------------------------------------------------------------------

def sequence(name: str, tokens: tuple[int, ...]) -> Sequence:
    seq = Sequence(Request(name, tokens))
    extend_hashes(seq, seq.num_tokens, BLOCK)
    return seq


def run_step(plan: TierPlan, step_id: int, bad=(), failed=()):
    step = plan.take(step_id)
    if step is not None:
        plan.finished(step_id, bad, failed, 0.001)
    return step


def test_a_prompt_found_in_a_tier_past_the_pool_loads_it_then_runs_the_rest():
    blocks = BlockManager(12, BLOCK, enable_caching=True)
    tiers = KVTiers([TierIndex("host", 16)], BLOCK, 1024)
    plan = TierPlan(tiers, blocks)
    old = sequence("old", tuple(range(80)))                 # 5 full blocks
    old.block_table = blocks.grow("old", 80)
    blocks.register("old", old.block_hashes)
    blocks.free("old")
    blocks.grow("filler", 12 * BLOCK)                       # every cached block leaves the pool
    run_step(plan, 0)
    assert len(tiers.tiers[0]) == 5 and blocks.num_cached == 0
    blocks.free("filler")
    scheduler = PrefillScheduler(blocks, 64, 8)
    scheduler.tiers = plan
    again = sequence("again", tuple(range(80)) + (1, 2, 3))
    scheduler.add(again)
    assert scheduler.schedule() == () and again.loading     # admitted; its 5 blocks load first
    assert again.num_computed_tokens == 80
    assert scheduler.schedule() == ()                        # nothing runs while they load
    step = run_step(plan, 1)
    assert [c.block for c in step.loads] == again.block_table[:5] and not again.loading
    (chunk,) = scheduler.schedule()
    assert (chunk.start, chunk.num_tokens, again.num_cached_tokens) == (80, 3, 80)
    assert blocks.match(again.block_hashes) == again.block_table[:5]     # registered once loaded
    assert tiers.stats()[0].hit_tokens == 80
    blocks.check_consistency()
    tiers.check_consistency()


def test_a_load_that_fails_its_check_is_recomputed_from_that_block_on():
    blocks = BlockManager(12, BLOCK, enable_caching=True)
    tiers = KVTiers([TierIndex("disk", 16)], BLOCK, 1024)
    plan = TierPlan(tiers, blocks)
    seq = sequence("s", tuple(range(70)))
    for i, d in enumerate(seq.block_hashes):
        tiers.tiers[0].commit(tiers.tiers[0].reserve(d))
    seq.block_table = blocks.grow("s", 70)
    assert plan.load_prefix(seq, 0, 4) == 4
    run_step(plan, 0, bad=(2,))
    assert seq.num_computed_tokens == seq.num_cached_tokens == 2 * BLOCK and not seq.loading
    assert tiers.tiers[0].bad_blocks == 1 and tiers.tiers[0].hits == 2
    assert blocks.match(seq.block_hashes) == seq.block_table[:2]
    tiers.check_consistency()


def test_an_eviction_waits_for_no_later_step():
    blocks = BlockManager(2, BLOCK, enable_caching=True)
    plan = TierPlan(KVTiers([TierIndex("host", 4)], BLOCK, 1024), blocks)
    seq = sequence("s", tuple(range(32)))
    seq.block_table = blocks.grow("s", 32)
    blocks.register("s", seq.block_hashes)
    blocks.free("s")
    assert not plan.has_work
    blocks.grow("t", 16)                                    # evicts one, whatever the step comes to
    blocks.free("t")
    assert plan.has_work
    assert [(c.block, c.digest) for c in plan.take(0).saves] == [(1, seq.block_hashes[1])]   # the tail first
    assert not plan.has_work


def test_an_abandoned_step_gives_back_its_pending_writes_and_pins():
    blocks = BlockManager(6, BLOCK, enable_caching=True)
    tiers = KVTiers([TierIndex("host", 8)], BLOCK, 1024)
    plan = TierPlan(tiers, blocks)
    seq = sequence("s", tuple(range(40)))
    tiers.tiers[0].commit(tiers.tiers[0].reserve(seq.block_hashes[0]))
    seq.block_table = blocks.grow("s", 40)
    blocks.evicted.append((5, digest(99)))
    plan.load_prefix(seq, 0, 2)
    step = plan.take(0)
    assert step.saves and step.loads and tiers.tiers[0].num_pinned == 1
    plan.abandon(0)
    assert tiers.tiers[0].num_pinned == 0 and tiers.tiers[0].num_pending == 0
    tiers.check_consistency()


@pytest.mark.parametrize("seed", range(3))
def test_random_admissions_evictions_and_loads_keep_pool_and_tiers_consistent(seed):
    rng = random.Random(seed)
    blocks = BlockManager(24, BLOCK, enable_caching=True)
    tiers = KVTiers([TierIndex("host", 10), TierIndex("disk", 30)], BLOCK, 1024)
    plan = TierPlan(tiers, blocks)
    scheduler = PrefillScheduler(blocks, 48, 4)
    scheduler.tiers = plan
    stems = [tuple(rng.randrange(500) for _ in range(96)) for _ in range(6)]
    live: list[Sequence] = []
    for step_id in range(300):
        if rng.random() < 0.5:
            scheduler.add(sequence(f"s{step_id}", rng.choice(stems)[:rng.randrange(20, 96)] + (step_id,)))
        for chunk in scheduler.schedule():
            if chunk.sample:
                live.append(chunk.seq)
        run_step(plan, step_id, bad=(0,) if rng.random() < 0.05 else ())
        for seq in live:                                    # their prefill ran: full blocks registered
            full = seq.num_tokens // BLOCK
            blocks.register(seq.request_id, seq.block_hashes[:full], seq.num_registered_blocks)
            seq.num_registered_blocks = full
        while live and (rng.random() < 0.4 or blocks.num_free < 8):
            blocks.free(live.pop(rng.randrange(len(live))).request_id)
        blocks.check_consistency()
        tiers.check_consistency()
        assert all(len(t) <= t.num_slots for t in tiers.tiers)
    assert tiers.stats()[0].hit_tokens + tiers.stats()[1].hit_tokens > 0


def test_a_stop_keeps_the_most_recent_cached_blocks_on_the_disk_tier_only():
    """`TierPlan.keep`: blocks still in the pool go to the tier that outlives the process, the most recently
    registered up to its size, and not to the host tier (lost with the process); held ones are not written twice."""
    blocks = BlockManager(8, BLOCK, enable_caching=True)
    host, disk = TierIndex("host", 8), TierIndex("disk", 3)
    plan = TierPlan(KVTiers([host, disk], BLOCK, 64), blocks)
    blocks.grow("s", 6 * BLOCK)
    blocks.register("s", [digest(n) for n in range(6)])
    blocks.free("s")
    written(disk, 5)
    assert plan.keep(blocks.cached_blocks())
    step = plan.take(1)
    assert [(c.tier, c.digest) for c in step.saves] == [(1, digest(3)), (1, digest(4))]
    assert {c.block for c in step.saves} == {blocks.cached_blocks()[3][0], blocks.cached_blocks()[4][0]}
    plan.finished(1, (), (), 0.0)
    assert len(disk) == 3 and len(host) == 0 and not plan.has_work
