"""Scheduling policy on plain sequences: priority, chunking, interleaving, round robin, preemption."""
from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.messages import Request
from engine.core.scheduler import DecodeScheduler, PrefillScheduler
from engine.core.sequence import Sequence


def seq(name: str, prompt_len: int, priority: int = 0) -> Sequence:
    return Sequence(Request(name, tuple(range(3, 3 + prompt_len)), priority=priority))


def run_prefill(scheduler: PrefillScheduler) -> list[list[tuple[str, int]]]:
    steps = []
    while batch := scheduler.schedule():
        steps.append([(c.seq.request_id, c.num_tokens) for c in batch.chunks])
        for chunk in batch.chunks:
            scheduler.advance(chunk)
            if chunk.sample:
                scheduler.remove(chunk.seq)
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


def test_admission_stops_when_the_reservation_is_refused():
    refused = {"b"}
    scheduler = PrefillScheduler(BlockManager(100, 16), 100, 8, reserve=lambda s: s.request_id not in refused)
    for name in "abc":
        scheduler.add(seq(name, 5))
    batch = scheduler.schedule()
    assert [c.seq.request_id for c in batch.chunks] == ["a"]        # back-pressure keeps arrival order
    refused.clear()
    scheduler.advance(batch.chunks[0])
    scheduler.remove(batch.chunks[0].seq)
    assert [c.seq.request_id for c in scheduler.schedule().chunks] == ["b", "c"]


def decode_seq(name: str, blocks: BlockManager, context: int, priority: int = 0) -> Sequence:
    s = seq(name, context, priority)
    s.output_token_ids = [1]
    s.num_computed_tokens = context
    s.block_table = blocks.grow(name, context + 1)
    return s


def test_decode_round_robin_when_more_sequences_than_batch_slots():
    blocks = BlockManager(100, 16)
    scheduler = DecodeScheduler(blocks, max_num_seqs=2, on_preempt=lambda s: None)
    for name in "abc":
        scheduler.add(decode_seq(name, blocks, 4))
    picked = []
    for _ in range(3):
        batch = scheduler.schedule()
        picked.append(sorted(c.seq.request_id for c in batch.chunks))
    assert picked == [["a", "b"], ["a", "c"], ["b", "c"]]


def test_out_of_blocks_preempts_lowest_priority_newest():
    blocks = BlockManager(5, 4)
    preempted = []
    scheduler = DecodeScheduler(blocks, max_num_seqs=8, on_preempt=preempted.append)
    for name, priority in (("old-low", 0), ("high", 1), ("new-low", 0)):
        s = decode_seq(name, blocks, 3, priority)          # 4 tokens: one full block each
        s.output_token_ids.append(2)                        # the next step needs a second block
        scheduler.add(s)
    batch = scheduler.schedule()
    assert [s.request_id for s in preempted] == ["new-low"]
    assert sorted(c.seq.request_id for c in batch.chunks) == ["high", "old-low"]
    assert preempted[0].num_computed_tokens == 0 and not blocks.holds("new-low")
    blocks.check_consistency()
