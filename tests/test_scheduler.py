"""Scheduling policy on plain sequences: priority, chunking, interleaving, round robin, preemption."""
from __future__ import annotations

import random

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.scheduler import DecodeScheduler, PrefillScheduler
from pdserve.engine.core.sequence import Sequence


def seq(name: str, prompt_len: int, priority: int = 0, max_tokens: int = 16) -> Sequence:
    return Sequence(Request(name, tuple(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                            priority=priority))


def run_prefill(scheduler: PrefillScheduler) -> list[list[tuple[str, int]]]:
    steps = []
    while chunks := scheduler.schedule():
        steps.append([(c.seq.request_id, c.num_tokens) for c in chunks])
    return steps


def test_priority_then_arrival_order():
    scheduler = PrefillScheduler(BlockManager(100, 16), max_prefill_tokens=10, max_num_seqs=8)
    for s in (seq("low-1", 4), seq("high", 4, priority=5), seq("low-2", 4)):
        scheduler.add(s)
    assert run_prefill(scheduler) == [[("high", 4), ("low-1", 4), ("low-2", 2)], [("low-2", 2)]]


def test_long_prompt_is_chunked_and_short_prompts_run_between_its_chunks():
    scheduler = PrefillScheduler(BlockManager(100, 16), max_prefill_tokens=64, max_num_seqs=8)
    scheduler.add(seq("long", 200))
    scheduler.add(seq("short", 10))
    steps = run_prefill(scheduler)
    assert steps[0] == [("long", 64)]
    assert steps[1] == [("short", 10), ("long", 54)]
    assert all(sum(n for _, n in step) <= 64 for step in steps)
    assert sum(n for step in steps for name, n in step if name == "long") == 200


def test_chunks_advance_when_scheduled_and_the_last_one_samples_once():
    scheduler = PrefillScheduler(BlockManager(100, 16), max_prefill_tokens=32, max_num_seqs=8)
    s = seq("a", 70)
    scheduler.add(s)
    chunks = [scheduler.schedule()[0] for _ in range(3)]          # no step has finished yet
    assert [(c.start, c.num_tokens, c.sample) for c in chunks] == [(0, 32, False), (32, 32, False), (64, 6, True)]
    assert s.num_computed_tokens == 70 and s.num_in_flight == 1
    assert len(scheduler) == 0 and scheduler.schedule() == ()


def test_admission_stops_when_the_reservation_is_refused():
    refused = {"b"}
    scheduler = PrefillScheduler(BlockManager(100, 16), 100, 8, reserve=lambda s: s.request_id not in refused)
    for name in "abc":
        scheduler.add(seq(name, 5))
    assert [c.seq.request_id for c in scheduler.schedule()] == ["a"]   # back-pressure keeps arrival order
    refused.clear()
    assert [c.seq.request_id for c in scheduler.schedule()] == ["b", "c"]


def test_removed_sequences_are_skipped_and_not_found():
    scheduler = PrefillScheduler(BlockManager(100, 16), 100, 8)
    seqs = [seq(f"s{i}", 3) for i in range(6)]
    for s in seqs:
        scheduler.add(s)
    for s in seqs[::2]:
        scheduler.remove(s)
    assert scheduler.find("s0") is None and scheduler.find("s1") is seqs[1] and len(scheduler) == 3
    assert [c.seq.request_id for c in scheduler.schedule()] == ["s1", "s3", "s5"]


def decode_seq(name: str, blocks: BlockManager, context: int, priority: int = 0, max_tokens: int = 16) -> Sequence:
    s = seq(name, context, priority, max_tokens)
    s.output_token_ids = [1]
    s.num_computed_tokens = context
    s.block_table = blocks.grow(name, context + 1)
    return s


def freeing(blocks: BlockManager, preempted: list):
    def on_preempt(s: Sequence) -> None:
        preempted.append(s)
        blocks.free(s.request_id)
    return on_preempt


def test_decode_round_robin_when_more_sequences_than_batch_slots():
    blocks = BlockManager(100, 16)
    scheduler = DecodeScheduler(blocks, max_num_seqs=2, on_preempt=freeing(blocks, []))
    for name in "abc":
        scheduler.add(decode_seq(name, blocks, 4))
    picked = [sorted(s.request_id for s in scheduler.schedule()) for _ in range(3)]
    assert picked == [["a", "b"], ["a", "c"], ["b", "c"]]


def test_higher_priority_first_then_the_rest_round_robin():
    blocks = BlockManager(100, 16)
    scheduler = DecodeScheduler(blocks, max_num_seqs=3, on_preempt=freeing(blocks, []))
    for name, priority in (("a", 0), ("b", 0), ("hi", 2), ("c", 0)):
        scheduler.add(decode_seq(name, blocks, 4, priority))
    picked = [[s.request_id for s in scheduler.schedule()] for _ in range(3)]
    assert picked == [["hi", "a", "b"], ["hi", "c", "a"], ["hi", "b", "c"]]


def test_a_step_in_flight_counts_toward_max_tokens():
    blocks = BlockManager(100, 16)
    scheduler = DecodeScheduler(blocks, max_num_seqs=8, on_preempt=freeing(blocks, []))
    s = decode_seq("a", blocks, 4, max_tokens=3)           # one output so far: two more may be planned
    scheduler.add(s)
    assert [len(scheduler.schedule()) for _ in range(3)] == [1, 1, 0]
    assert s.num_in_flight == 2 and s.num_computed_tokens == 6


def test_out_of_blocks_preempts_lowest_priority_newest():
    blocks = BlockManager(5, 4)
    preempted = []
    scheduler = DecodeScheduler(blocks, max_num_seqs=8, on_preempt=freeing(blocks, preempted))
    for name, priority in (("old-low", 0), ("high", 1), ("new-low", 0)):
        s = decode_seq(name, blocks, 3, priority)          # 4 tokens: one full block each
        s.output_token_ids.append(2)                        # the next position needs a second block
        s.num_computed_tokens += 1
        scheduler.add(s)
    batch = scheduler.schedule()
    assert [s.request_id for s in preempted] == ["new-low"]
    assert sorted(s.request_id for s in batch) == ["high", "old-low"]
    assert not blocks.holds("new-low") and scheduler.find("new-low") is None
    blocks.check_consistency()


def test_blocks_held_by_a_step_in_flight_are_waited_for_not_preempted_for():
    blocks = BlockManager(3, 4)
    preempted = []
    scheduler = DecodeScheduler(blocks, max_num_seqs=8, on_preempt=freeing(blocks, preempted))
    a, b = decode_seq("a", blocks, 3), decode_seq("b", blocks, 3)
    leaving = decode_seq("c", blocks, 3)
    blocks.free_after("c", fence=7)                         # "c" finished while a step still holds its block
    for s in (a, b):
        s.output_token_ids.append(2)
        s.num_computed_tokens += 1
        scheduler.add(s)
    assert [s.request_id for s in scheduler.schedule()] == []     # both need a block; one is coming
    assert preempted == [] and scheduler.find(leaving.request_id) is None
    blocks.release_through(7)
    assert scheduler.schedule() == (a,)                     # the older one gets it; nothing else is coming,
    assert preempted == [b]                                 # so the newer one makes room for itself
    blocks.check_consistency()


def test_random_adds_and_removes_keep_order_and_counts():
    blocks = BlockManager(1000, 16)
    scheduler = DecodeScheduler(blocks, max_num_seqs=1000, on_preempt=freeing(blocks, []))
    rng, live = random.Random(0), {}
    for i in range(300):
        if live and rng.random() < 0.4:
            victim = live.pop(rng.choice(sorted(live)))
            scheduler.remove(victim)
            blocks.free(victim.request_id)
        else:
            s = decode_seq(f"s{i}", blocks, 2, priority=rng.randrange(3), max_tokens=10_000)
            live[s.request_id] = s
            scheduler.add(s)
        assert len(scheduler) == len(live)
    expected = sorted(live.values(), key=lambda s: (-s.priority, int(s.request_id[1:])))
    assert list(scheduler.schedule()) == expected


def test_admitted_prompts_keep_their_chunks_while_admission_is_refused():
    refused = set()
    scheduler = PrefillScheduler(BlockManager(100, 16), max_prefill_tokens=16, max_num_seqs=8,
                                 reserve=lambda s: s.request_id not in refused)
    scheduler.add(seq("long", 60))
    assert [(c.seq.request_id, c.num_tokens) for c in scheduler.schedule()] == [("long", 16)]
    refused.add("blocked")
    scheduler.add(seq("blocked", 4, priority=1))        # first in line, but cannot be admitted now
    steps = [[c.seq.request_id for c in scheduler.schedule()] for _ in range(3)]
    assert steps == [["long"], ["long"], ["long"]]     # was: nothing, forever
    refused.clear()
    assert [c.seq.request_id for c in scheduler.schedule()] == ["blocked"]
