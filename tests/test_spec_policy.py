"""Where speculation pays: per-row draft lengths from recent acceptance, none in large steps; and the
spec-decode counters as the server exports them and `pdserve bench` reads them."""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from pdserve.bench.loadtest import format_spec_decode
from pdserve.bench.server_metrics import parse_prefix_cache, prefix_cache_delta, spec_decode_delta
from pdserve.engine.coordinator.slo import HEADROOM
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import ActorStats, EngineStats, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.scheduler import DecodeScheduler, PrefillScheduler, mixed_batch
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.spec_policy import SHAPE_MEMORY_STEPS, Acceptance, DraftGate, StepBudget, allot
from pdserve.engine.core.speculative import MISSES_BEFORE_BACKOFF, SpeculativeConfig, Speculator
from pdserve.server.cli import add_serve_arguments, server_config_from_args
from pdserve.server.metrics import Metrics

REPEATING = (1, 2, 3, 4, 5, 6, 7, 8) * 4


def sequence(prompt=REPEATING, max_tokens=100) -> Sequence:
    return Sequence(Request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)), [1])


def test_rows_draft_one_past_what_was_kept_and_pause_after_misses():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=3))
    seq = sequence()
    assert speculator.drafts(seq, 10) == (2, 3, 4, 5, 6)
    speculator.observe(seq, 5, 1)
    assert len(speculator.drafts(seq, 10)) == 2                  # one more than the one kept
    speculator.observe(seq, 2, 2)
    assert len(speculator.drafts(seq, 10)) == 4                  # all kept: twice as many
    assert len(speculator.drafts(seq, 2)) == 2                   # max_tokens / context room caps it
    speculator.observe(seq, 4, 4)
    assert len(speculator.drafts(seq, 10)) == 5                  # up to num_speculative_tokens
    speculator.observe(seq, 5, 2)
    assert len(speculator.drafts(seq, 10)) == 3
    for _ in range(MISSES_BEFORE_BACKOFF):
        speculator.observe(seq, 1, 0)
    assert speculator.drafts(seq, 10) == ()                      # paused
    assert speculator.drafts(seq, 10) == (2,)                    # then probes again with one draft
    speculator.observe(seq, 1, 0)
    assert speculator.drafts(seq, 10) == () and speculator.drafts(seq, 10) == ()   # a longer pause
    assert speculator.drafts(seq, 10) == (2,)
    speculator.observe(seq, 1, 1)
    assert len(speculator.drafts(seq, 10)) == 2
    c = speculator.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (8, 20, 10)
    assert c.accepted_per_position == [5, 3, 1, 1, 0]


def test_large_steps_draft_nothing_and_drafts_take_only_free_blocks():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2,
                               disable_by_batch_size=2)
    blocks = BlockManager(num_blocks=12, block_size=16)
    scheduler = DecodeScheduler(blocks, 8, on_preempt=lambda seq: None, speculator=Speculator(config))
    seqs = [sequence() for _ in range(3)]
    for i, seq in enumerate(seqs):
        seq.request = Request(f"r{i}", REPEATING + REPEATING[:14] * (i == 1), seq.params)
        seq.block_table = blocks.grow(seq.request_id, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        scheduler.add(seq)
    assert all(not s.drafts for s in scheduler.schedule())       # 3 rows > disable_by_batch_size
    for seq in seqs:
        seq.num_in_flight, seq.num_computed_tokens = 0, seq.num_tokens - 1
    scheduler.remove(seqs[2])
    blocks.free(seqs[2].request_id)
    while blocks.num_free:                                       # no free block: a draft must fit the last one
        blocks.grow(f"hog{blocks.num_free}", 16)
    chosen = scheduler.schedule()
    assert [len(s.drafts) for s in chosen] == [3, 1]             # 3 blocks hold 48 tokens: 33 + 3, 47 + 1


FIXED, PER_ROW, PER_TOKEN = 0.020, 0.0005, 0.002      # seconds: a step's fixed cost, per decode row, per token


def seeded_cost(seed=0) -> StepCostModel:
    """A step cost model fit to noisy steps of a known linear cost."""
    rng, cost = np.random.default_rng(seed), StepCostModel()
    for _ in range(80):
        rows, tokens = int(rng.integers(1, 40)), int(rng.integers(0, 64))
        cost.observe(2, rows, tokens, FIXED + PER_ROW * rows + PER_TOKEN * tokens + rng.normal(0, 2e-5))
    return cost


def best_lengths(rates, caps, rows, budget):
    """Brute force: the draft lengths with the most expected tokens per second within the time limit."""
    def seconds(lengths):
        return budget.plain + (budget.first if sum(lengths) else 0.0) + budget.per_draft * sum(lengths)

    def rate(lengths):
        return (rows + sum(r ** j for r, n in zip(rates, lengths) for j in range(1, n + 1))) / seconds(lengths)
    fits = [n for n in itertools.product(*(range(c + 1) for c in caps)) if seconds(n) <= budget.limit]
    return list(max(fits, key=rate)), rate


def with_probes(lengths, caps, budget):
    """A drafting row left without drafts probes with one, while the step stays within its limit."""
    lengths, seconds = list(lengths), budget.plain + budget.first + budget.per_draft * sum(lengths)
    for i, cap in enumerate(caps):
        if cap and not lengths[i] and seconds + budget.per_draft <= budget.limit:
            seconds, lengths[i] = seconds + budget.per_draft, 1
    return lengths


def test_drafts_are_taken_best_first_while_they_raise_the_steps_token_rate():
    gate = DraftGate(num_speculative_tokens=16, disable_by_batch_size=None)
    assert gate.budget(1, 0) == StepBudget() and gate.budget(3, 0) is None     # unmeasured: the roofline guess
    gate.use(seeded_cost(), learns=False)
    for rows, rates in ((1, (0.6,)), (1, (0.95,)), (4, (0.3, 0.8)), (4, (0.7, 0.9, 0.5)), (12, (0.97, 0.6))):
        budget = gate.budget(rows, 0)
        assert budget.plain == pytest.approx(FIXED + PER_ROW * rows, rel=0.02)
        assert budget.per_draft == pytest.approx(PER_TOKEN, rel=0.02)
        lone = FIXED + PER_ROW                                 # no SLO known: the SLO's own share of a lone row's step
        assert budget.limit == pytest.approx(max(budget.plain, HEADROOM * lone), rel=0.02)
        caps = [6] * len(rates)
        best, rate = best_lengths(rates, caps, rows, budget)
        assert allot(rates, caps, rows, budget) == with_probes(best, caps, budget)
        assert rate(best) >= rows / budget.plain               # the step yields tokens no slower
        unbounded = replace(budget, limit=math.inf)
        assert allot(rates, caps, rows, unbounded) == with_probes(best_lengths(rates, caps, rows, unbounded)[0],
                                                                  caps, unbounded)
    lone = StepBudget(plain=0.029, per_draft=0.0005, limit=0.058, first=0.012)   # a one-row step's dear first draft
    for rates in ((0.3,), (0.5,), (0.6,), (0.9,)):
        best, rate = best_lengths(rates, [7], 1, lone)
        assert allot(rates, [7], 1, lone) == with_probes(best, [7], lone)
    assert allot((0.3,), [7], 1, lone) == [1] and allot((0.9,), [7], 1, lone) == [7]    # a probe; every draft
    assert gate.threshold(1, 0) == pytest.approx(PER_TOKEN / (FIXED + PER_ROW), rel=0.02)
    assert gate.budget(14, 0) is None                           # 14 * c >= T0: no draft can pay
    assert gate.budget(1, 8) is None                            # a step carrying prefill drafts nothing
    assert DraftGate(4, disable_by_batch_size=2).budget(3, 0) is None


def test_a_step_with_drafts_stays_within_the_itl_slo_trimming_the_least_accepted_rows_first():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=16, prompt_lookup_min=1, prompt_lookup_max=3))
    speculator.gate.use(seeded_cost(), learns=False)
    blocks = BlockManager(num_blocks=64, block_size=16)
    scheduler = DecodeScheduler(blocks, 8, on_preempt=lambda seq: None, speculator=speculator)
    text = tuple(range(100, 140))
    likely, unlikely = (Sequence(Request(name, text + text[:5], SamplingParams(max_tokens=100, temperature=0.0)),
                                 [text[5]]) for name in ("likely", "unlikely"))
    for _ in range(10):
        speculator.observe(likely, 4, 4)                        # nearly every draft kept: 16 next
    speculator.observe(unlikely, 16, 12)                        # 12 of 16: 13 next, at a lower rate
    for seq in (likely, unlikely):
        seq.block_table = blocks.grow(seq.request_id, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        scheduler.add(seq)

    def drafted(itl_slo):
        speculator.serve(itl_slo)
        lengths = {seq.request_id: len(seq.drafts) for seq in scheduler.schedule()}
        for seq in (likely, unlikely):                          # undo the step
            seq.num_in_flight, seq.num_computed_tokens, seq.drafts = 0, seq.num_tokens - 1, ()
        return lengths, FIXED + 2 * PER_ROW + PER_TOKEN * sum(lengths.values())

    plain, lone = FIXED + 2 * PER_ROW, FIXED + PER_ROW
    bounded, seconds = drafted(None)                            # the rate rule alone: 16 + 4 drafts, 61 ms
    assert seconds <= HEADROOM * lone                           # no SLO known: the SLO's share of a lone row's step
    budget = speculator.gate.budget(2, 0)
    assert budget.limit == pytest.approx(HEADROOM * lone, rel=0.02)
    assert bounded == {"likely": int((budget.limit - budget.plain) / budget.per_draft), "unlikely": 0}
    bounded, seconds = drafted(0.040)
    assert seconds <= 0.040                                     # 9 drafts fill the SLO's room, the likelier row's
    assert bounded == {"likely": int((0.040 - FIXED - 2 * PER_ROW) / PER_TOKEN), "unlikely": 0}
    assert drafted(0.015)[0] == {"likely": 0, "unlikely": 0}    # already past the SLO without drafts: none


def test_a_verify_cost_measured_long_ago_does_not_keep_drafting_shut():
    gate = DraftGate(num_speculative_tokens=4, disable_by_batch_size=None)
    gate.observe_step(2, 4, 1.0, threads=2, drafts=4)           # one verify step slowed by something else
    for _ in range(3):
        gate.observe_step(2, 0, 0.020, threads=2, drafts=0)
    assert gate.budget(2, 0) is None                            # a draft looks dearer than the step: none
    for _ in range(200):
        gate.observe_step(2, 0, 0.020, threads=2, drafts=0)
    assert gate.budget(2, 0) == StepBudget()                    # faded: the roofline guess drafts (and measures)
    gate.observe_step(2, 4, 0.024, threads=2, drafts=4)
    assert gate.budget(2, 0).per_draft < 0.002                  # the new step now weighs most (1 ms a draft)


def test_a_step_shape_measured_dear_caps_the_drafts_below_it_until_it_is_tried_again():
    def step_time(positions):                                   # 1 ms a draft; past six positions the kernels'
        return 0.020 + 0.001 * (positions - 1) + 0.008 * (positions > 6)     # path changes: 8 ms more

    gate = DraftGate(num_speculative_tokens=7, disable_by_batch_size=None)
    for _ in range(3):
        for drafts in range(8):
            gate.observe_step(1, drafts, step_time(1 + drafts), threads=2, drafts=drafts)
    budget = gate.budget(1, 0)
    assert [budget.seconds(d) for d in range(8)] == pytest.approx([step_time(1 + d) for d in range(8)])
    assert allot((0.95,), [7], 1, budget) == [5]                # the sixth draft crosses into the dear shape
    for _ in range(SHAPE_MEMORY_STEPS + 1):
        gate.observe_step(1, 5, step_time(6), threads=2, drafts=5)
    again = gate.budget(1, 0)
    assert len(again.measured) == 6                             # the dear shape, not run lately, is forgotten
    assert again.seconds(6) == pytest.approx(step_time(6) + again.per_draft)    # priced from the shape below
    assert allot((0.95,), [7], 1, again) == [7]                 # and tried again


def test_a_rows_acceptance_estimate_follows_its_verifications():
    acceptance = Acceptance()
    assert acceptance.rate(0.5) == 0.5
    for _ in range(20):
        acceptance.observe(4, 4)
    assert acceptance.rate(0.5) > 0.95
    for _ in range(20):
        acceptance.observe(4, 0)
    assert acceptance.rate(0.5) < 0.15                         # the prior weighs one trial


def test_steps_with_many_rows_or_prefill_chunks_draft_nothing():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    speculator = Speculator(config)
    speculator.gate.use(seeded_cost(1), learns=False)
    blocks = BlockManager(num_blocks=64, block_size=16)
    scheduler = DecodeScheduler(blocks, 32, on_preempt=lambda seq: None, speculator=speculator)
    prefill = PrefillScheduler(blocks, 64, 32)

    def running(n):
        for seq in scheduler.running:
            scheduler.remove(seq)
            blocks.free(seq.request_id)
        for i in range(n):
            seq = sequence()
            seq.request = Request(f"r{n}-{i}", REPEATING, seq.params)
            seq.block_table = blocks.grow(seq.request_id, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens - 1
            scheduler.add(seq)

    running(2)
    assert all(s.drafts for s in scheduler.schedule())
    running(16)                                                 # 16 * c > T0
    assert not any(s.drafts for s in scheduler.schedule())
    running(2)
    prefill.add(Sequence(Request("p", tuple(range(40)), SamplingParams(max_tokens=4))))
    batch = mixed_batch(scheduler, prefill, lambda rows: 64)
    assert batch.chunks and not batch.verify                    # next to a prefill chunk: no drafts
    assert all(s.num_computed_tokens == s.num_tokens for s in scheduler.running if s.request_id != "p")


def test_counters_are_exported_with_vllms_meaning_and_bench_reads_them():
    spec = dict(spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=12, spec_accepted_per_position=(7, 4, 1))
    stats = EngineStats((ActorStats("prefill", 0, 0, 0, 10, 3, 0.0),
                         ActorStats("decode", 1, 0, 2, 10, 3, 0.0, **spec)), 1, 0)
    text = Metrics(lambda: stats, lambda: []).render().decode()
    for line in ("pdserve_spec_decode_num_drafts_total 10.0", "pdserve_spec_decode_num_draft_tokens_total 30.0",
                 "pdserve_spec_decode_num_accepted_tokens_total 12.0",
                 'pdserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4.0'):
        assert line in text
    before = parse_prefix_cache(text.replace("30.0", "10.0").replace("total 12.0", "total 2.0")
                                .replace("drafts_total 10.0", "drafts_total 4.0"))
    after = parse_prefix_cache(text)
    delta = spec_decode_delta(before, after)
    assert delta["acceptance_rate"] == 10 / 20 and delta["mean_acceptance_length"] == 1 + 10 / 6
    assert "50.0% of 20 draft tokens" in format_spec_decode(delta)
    assert set(prefix_cache_delta(before, after)["actors"]) == {"prefill", "decode"}
    plain = Metrics(lambda: EngineStats((ActorStats("decode", 1, 0, 2, 10, 3, 0.0),), 1, 0), lambda: [])
    assert "spec_decode" not in plain.render().decode()
    assert spec_decode_delta(after, parse_prefix_cache(plain.render().decode())) is None


def test_serve_takes_the_option():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    spelled = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    config = server_config_from_args(parser.parse_args(["--speculative-config", spelled])).engine.speculative
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    assert server_config_from_args(parser.parse_args([])).engine.speculative is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        server_config_from_args(parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 99}']))
