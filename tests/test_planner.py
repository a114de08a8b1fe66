"""The SLO planner on seeded cost models: deterministic decisions that follow the predicted SLO misses,
then throughput; core lending from predicted costs; the SLO defaults derived from measured steps."""
from __future__ import annotations

import argparse
import random

import pytest

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.modes.adaptive.decisions import LoadState, Running, Stream
from pdserve.engine.modes.adaptive.planner import Planner
from pdserve.engine.modes.adaptive.prefill_plans import Waiting
from pdserve.engine.coordinator.profile import MESSAGE_TOKENS, profile_shapes
from pdserve.engine.coordinator.slo import HEADROOM, KNEE, MeasuredUnits, Slos, derive_slos
from pdserve.engine.core.batch import Batch, ScheduledChunk, attention_pairs
from pdserve.engine.core.config import SchedulerConfig

SLOS = Slos(ttft=1.0, itl=0.05)


def linear_cost(fixed: float, per_row: float, per_token: float, threads=(None,), noise: float = 0.0,
                seed: int = 0) -> StepCostModel:
    """A cost model fed observations of a known linear step cost (within `noise`) at each thread count."""
    rng, cost = random.Random(seed), StepCostModel()
    for threads_ in threads:
        for _ in range(40):
            rows, tokens = rng.randrange(0, 32), rng.choice([0, 0, 16, 64, 512])
            seconds = (fixed + per_row * rows + per_token * tokens) * rng.uniform(1 - noise, 1 + noise)
            cost.observe(threads_, rows, tokens, seconds)
    return cost


def decode_cost(**kwargs) -> StepCostModel:
    return linear_cost(0.02, 0.001, 0.0005, **kwargs)       # 30 ms at 10 rows, 0.5 ms a prefill token


def state(rows=10, queue=(), backlog=0, prefill_busy=False, remaining=0) -> LoadState:
    return LoadState(rows, tuple(queue), backlog, prefill_busy=prefill_busy, decode_remaining=remaining)


def test_a_long_prompt_goes_remote_when_local_chunks_would_miss_the_slos():
    planner = Planner(SLOS, max_prefill_tokens=2048)
    prefill = linear_cost(0.01, 0.0, 0.0005)
    decision = planner.place(1000, 1000, state(), decode_cost(), prefill)
    assert not decision.local
    local = {p.chunk: p for p in decision.candidates if p.action == "local"}
    fitting = local[40]                              # (50 ms - 30 ms) / 0.5 ms: the step keeps the ITL SLO
    assert fitting.itl_misses == 0 and fitting.ttft_misses == 1        # 25 steps of 50 ms: past 1 s
    assert local[1000].itl_misses == 10 and local[1000].ttft_misses == 0      # one 530 ms step stalls every row
    assert decision.chosen.misses == 0 and decision.chosen.first_token == pytest.approx(0.51, rel=0.05)
    assert "remote" in decision.reason and "local chunks of 40" in decision.reason


def test_a_new_prompts_first_token_counts_from_its_arrival():
    """A prompt that waited (in the decode unit's mailbox, behind a step) before it is placed has that much less of
    its TTFT SLO left, wherever it goes."""
    planner = Planner(SLOS, max_prefill_tokens=2048)
    prefill = linear_cost(0.01, 0.0, 0.0005)
    fresh = planner.place(1000, 1000, state(), decode_cost(), prefill)
    late = planner.place(1000, 1000, state(), decode_cost(), prefill, waited=0.6)
    remote = [next(p for p in d.candidates if p.action == "remote") for d in (fresh, late)]
    assert remote[0].first_token == pytest.approx(remote[1].first_token)           # ~0.51 s from now
    assert (remote[0].ttft_misses, remote[1].ttft_misses) == (0, 1)                 # 0.6 + 0.51 s: past 1 s
    whole = [next(p for p in d.candidates if p.chunk == 1000) for d in (fresh, late)]
    assert (whole[0].ttft_misses, whole[1].ttft_misses) == (0, 1)                   # 0.6 + one 530 ms step


def test_streams_with_slack_under_their_mean_itl_absorb_a_local_prefill_and_spent_ones_do_not():
    planner = Planner(SLOS, max_prefill_tokens=4096)       # a typical prompt: 1,024 tokens, so the rule decides
    prefill = linear_cost(0.01, 0.0, 0.0009)          # e.g. one core, where the decode unit steps on two
    fresh = LoadState(10, (), 0, decode_remaining=64, streams=(Stream(remaining=64),) * 10)
    decision = planner.place(1000, 1000, fresh, decode_cost(), prefill)
    whole = next(p for p in decision.candidates if p.chunk == 1000)
    assert whole.misses == 0             # one 530 ms step over 64 tokens of 30 ms: a 38 ms mean, within 50 ms
    assert decision.local and decision.chosen.chunk == 1000       # more tok/s than 0.91 s on the prefill unit
    spent = LoadState(10, (), 0, decode_remaining=64, streams=(Stream(100, 6.5, 64),) * 10)   # 65 ms so far
    behind = planner.place(1000, 1000, spent, decode_cost(), prefill)
    assert next(p for p in behind.candidates if p.chunk == 1000).itl_misses == 10
    assert not behind.local and behind.chosen.misses == 0
    ending = LoadState(10, (), 0, streams=(Stream(100, 6.5, 0),) * 10)       # each ends with the step in flight
    assert planner.place(1000, 1000, ending, decode_cost(), prefill).chosen.chunk == 1000
    mixed = LoadState(10, (), 0, decode_remaining=64, streams=(Stream(remaining=64),) * 9 + (Stream(100, 6.5, 64),))
    assert next(p for p in planner.place(1000, 1000, mixed, decode_cost(), prefill).candidates
                if p.chunk == 1000).itl_misses == 1


def test_with_itl_slo_kind_max_one_long_step_is_a_miss_whatever_slack_the_streams_mean_has():
    """The case above with every gap counted: the 530 ms step the streams' mean absorbed misses for each of them."""
    planner = Planner(Slos(ttft=1.0, itl=0.05, itl_kind="max"), max_prefill_tokens=4096)    # a typical prompt
    prefill = linear_cost(0.01, 0.0, 0.0009)
    fresh = LoadState(10, (), 0, decode_remaining=64, streams=(Stream(remaining=64),) * 10)
    decision = planner.place(1000, 1000, fresh, decode_cost(), prefill)
    whole, fitting = (next(p for p in decision.candidates if p.action == "local" and test(p.chunk))
                      for test in (lambda chunk: chunk == 1000, lambda chunk: chunk < 1000))
    assert whole.itl_misses == 10 and fitting.itl_misses == 0
    assert fitting.chunk in (39, 40)         # a 50 ms step, less the fit's own error lately (max: every gap counts)
    assert not decision.local and decision.chosen.misses == 0
    ending = LoadState(10, (), 0, streams=(Stream(100, 6.5, 0),) * 10)       # nothing left to wait for: no miss
    assert planner.place(1000, 1000, ending, decode_cost(), prefill).chosen.chunk == 1000
    tight = Planner(Slos(ttft=1.0, itl=0.02, itl_kind="max"), 2048).place(1000, 1000, fresh, decode_cost(), prefill)
    assert tight.chosen.action == "remote" and tight.chosen.misses == 0     # decoding alone (30 ms) is past the
    assert all(p.itl_misses == 10 for p in tight.candidates if p.action == "local")   # SLO: only prefill's count


def test_the_itl_slo_kind_is_an_engine_option():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--itl-slo-kind", "max", "--itl-slo-ms", "80",
                                                        "--ttft-slo-ms", "900"]))
    assert config.scheduler.itl_slo_kind == "max"
    slos = derive_slos(config.scheduler, 4096, None)
    assert slos.itl_kind == "max" and "every gap" in slos.describe()
    assert derive_slos(SchedulerConfig(ttft_slo_ms=900, itl_slo_ms=80), 4096, None).itl_kind == "mean"


def test_a_prompt_goes_where_all_the_queued_prefill_ends_soonest_when_neither_choice_misses():
    planner = Planner(Slos(ttft=10.0, itl=0.05), max_prefill_tokens=2048)      # no first token misses here
    prefill = linear_cost(0.01, 0.0, 0.0005)                  # as fast a token as the decode unit
    queued = LoadState(0, (Waiting(128),) * 10, remote_backlog_tokens=8000)     # 0.7 s here, 4 s there
    decision = planner.place(128, 128, queued, decode_cost(), prefill)
    assert decision.local and decision.chosen.misses == 0
    remote = next(p for p in decision.candidates if p.action == "remote")
    assert remote.misses == 0 and remote.first_token == pytest.approx(4.1, rel=0.05)
    idle = planner.place(128, 128, LoadState(0, (Waiting(128),) * 10), decode_cost(), prefill)
    assert not idle.local                                     # an idle prefill unit: the work is shared


def test_a_prompt_is_not_sent_behind_the_prefill_step_in_flight_unseen():
    """The prefill unit's step in flight has left its queue (its chunks are scheduled): what is left of it counts
    before a new prompt's first token there. Unseen, a 62-token prompt was sent behind a 0.8 s step on an idle-looking
    prefill unit and got its first token after 1.56 s (Xeon-167, documents load, step-traced)."""
    planner = Planner(Slos(ttft=0.5, itl=0.05), max_prefill_tokens=2048)
    prefill = linear_cost(0.01, 0.0, 0.0005)
    idle = planner.place(30, 30, state(), decode_cost(), prefill)
    assert not idle.local                                   # an idle prefill unit: the work is shared
    long_step = (Running(2000, attention_pairs(0, 2000), None),)          # ~1.01 s, 0.2 s of it run
    behind = LoadState(10, (), 0, remote_running=long_step, remote_running_for=0.2)
    decision = planner.place(30, 30, behind, decode_cost(), prefill)
    remote = next(p for p in decision.candidates if p.action == "remote")
    assert remote.first_token == pytest.approx(idle.chosen.first_token + 0.81, rel=0.05) and remote.ttft_misses == 1
    assert decision.local and decision.chosen.misses == 0
    overdue = LoadState(10, (), 0, remote_running=long_step, remote_running_for=1.5)   # past its prediction: ending
    assert next(p for p in planner.place(30, 30, overdue, decode_cost(), prefill).candidates
                if p.action == "remote").first_token == pytest.approx(idle.chosen.first_token)


def test_a_prefill_units_step_carries_only_its_first_prompts_when_a_packed_chunk_would_miss_their_slo():
    """A full step packs a chunk of the next prompt behind the prompts it finishes; their first tokens wait for it."""
    planner = Planner(SLOS, max_prefill_tokens=2048)
    prefill = linear_cost(0.01, 0.0, 0.0005)                    # 2,048 tokens: ~1.03 s
    late = (Waiting(60, waited=0.5), Waiting(2048))
    decision = planner.prefill_budget(late, prefill, None)
    assert decision.chosen.action == "first prompts" and decision.chosen.chunk == 60
    assert decision.chosen.ttft_misses == 1                      # the document misses either way
    full = next(p for p in decision.candidates if p.action == "prefill")
    assert full.chunk == 2048 and full.ttft_misses == 2          # the short one's first token after 0.5 + 1.03 s
    roomy = Planner(Slos(ttft=10.0, itl=0.05), max_prefill_tokens=2048)
    packed = roomy.prefill_budget((Waiting(60), Waiting(1900)), prefill, None)   # no first token at risk: one step
    assert packed.chosen.action == "prefill" and packed.chosen.chunk == 2048 and packed.chosen.misses == 0
    split = next(p for p in packed.candidates if p is not packed.chosen)
    assert packed.chosen.tokens_per_second > split.tokens_per_second
    tail = (Waiting(40, waited=0.5, length=2088), Waiting(2000), Waiting(30))
    tail_first = planner.prefill_budget(tail, prefill, None)    # a prompt's tail is a first prompt as well
    assert [p.chunk for p in tail_first.candidates] == [2048, 2040, 40] and tail_first.chosen.chunk == 40


def test_a_prefill_units_step_candidates_halve_so_a_long_queue_of_short_prompts_costs_a_few_plans():
    planner = Planner(SLOS, max_prefill_tokens=2048)
    queue = tuple(Waiting(16, waited=0.01 * i) for i in range(200))
    decision = planner.prefill_budget(queue, linear_cost(0.01, 0.0, 0.0005), None)
    assert [p.chunk for p in decision.candidates] == [2048, 2032, 1008, 496, 240, 112, 48, 16]


def test_a_short_prompt_stays_local_when_it_fits_the_itl_slo():
    planner = Planner(SLOS, max_prefill_tokens=2048)
    slow_prefill = linear_cost(0.01, 0.0, 0.002)       # e.g. the prefill unit on one core, decode on two
    decision = planner.place(30, 30, state(), decode_cost(), slow_prefill)
    assert decision.local and decision.chosen.chunk == 30 and decision.chosen.misses == 0
    assert decision.chosen.step == pytest.approx(0.045, rel=0.05)
    backlogged = planner.place(30, 30, state(backlog=3000), decode_cost(), linear_cost(0.01, 0.0, 0.0005))
    assert backlogged.local                            # the prefill unit is 1.5 s behind: its first token would miss


def test_with_nothing_decoding_a_prompt_is_prefilled_locally_at_the_full_budget():
    planner = Planner(SLOS, max_prefill_tokens=512)
    decision = planner.place(128, 128, state(rows=0), decode_cost(), decode_cost())     # two alike units
    assert decision.local and decision.chosen.chunk == 128          # no stream to stall: a tie, kept here
    assert planner.step_budget(state(rows=0, queue=[Waiting(2000)]), decode_cost()).chosen.chunk == 512


def test_a_prompt_whose_local_step_outlasts_a_typical_first_token_goes_to_the_prefill_unit_where_no_miss_is_added():
    """Started here it would answer sooner, but in one decode step longer than a typical prompt's TTFT SLO: every
    prompt arriving during it, in no prediction, would be late (documents at 1 req/s: whole 2,048-token documents
    in 4.3 s decode steps while the prefill unit idled). Where the prefill unit would miss, it stays."""
    slos = Slos(ttft=0.4, itl=0.05, ttft_tokens=500)          # a typical prompt's 0.4 s, scaled past 500 tokens
    planner, prefill = Planner(slos, max_prefill_tokens=2048), linear_cost(0.01, 0.0, 0.0006)
    document = planner.place(1000, 1000, state(rows=0), decode_cost(), prefill)
    local = next(p for p in document.candidates if p.action == "local")
    assert local.misses == 0 and local.step > slos.ttft and local.first_token < document.chosen.first_token
    assert not document.local and document.chosen.misses == 0                 # 0.52 s here, 0.61 s there
    assert planner.place(500, 500, state(rows=0), decode_cost(), prefill).local      # a 0.27 s step: the sooner
    assert planner.place(100, 1000, state(rows=0), decode_cost(), prefill).local     # its prefix is cached here
    stated = Planner(Slos(ttft=10.0, itl=0.05), max_prefill_tokens=2048)     # an operator's bound no step outlasts
    assert stated.place(1000, 1000, state(rows=0), decode_cost(), prefill).local
    slow = planner.place(1000, 1000, state(rows=0), decode_cost(), linear_cost(0.01, 0.0, 0.0009))
    assert slow.local and slow.chosen.misses == 0              # 0.91 s there: past its 0.8 s


def test_the_step_budget_keeps_a_decode_step_within_the_itl_slo_until_ttft_misses_outnumber_the_streams():
    planner, cost = Planner(SLOS, max_prefill_tokens=2048), decode_cost()
    budget = planner.step_budget(state(queue=[Waiting(100)]), cost).chosen
    assert budget.chunk == 40 and cost.predict(None, 10, budget.chunk) == pytest.approx(0.05, rel=0.05)
    assert planner.step_budget(state(queue=[Waiting(25)]), cost).chosen.chunk == 25       # fits whole
    planner = Planner(Slos(ttft=1.5, itl=0.05), max_prefill_tokens=2048)
    piled = planner.step_budget(state(rows=2, queue=[Waiting(100)] * 20), cost)   # chunks of 56: the last 4 miss
    fitting = next(p for p in piled.candidates if p.chunk == 56)
    assert fitting.ttft_misses == 4 and fitting.itl_misses == 0
    assert piled.chosen.chunk == 2000 and (piled.chosen.ttft_misses, piled.chosen.itl_misses) == (0, 2)
    fewer = planner.step_budget(state(rows=2, queue=[Waiting(100)] * 15), cost)    # every one in time at 56
    assert fewer.chosen.chunk == 56 and fewer.chosen.misses == 0


def test_without_a_cheaper_prefill_unit_a_prompt_waits_for_the_streams_to_end_rather_than_stall_them():
    planner = Planner(Slos(ttft=1.0, itl=0.0301), max_prefill_tokens=2048)   # a decode step alone: 30 ms
    cost = decode_cost()
    waiting = planner.step_budget(state(queue=[Waiting(300)], remaining=20), cost)    # they end in 0.6 s
    assert waiting.chosen.action == "wait" and waiting.chosen.chunk == 0 and waiting.chosen.misses == 0
    assert all(p.itl_misses == 10 for p in waiting.candidates if p.action == "local")
    assert waiting.chosen.first_token == pytest.approx(0.6 + 0.02 + 0.15, rel=0.05)
    long_streams = planner.step_budget(state(queue=[Waiting(300)], remaining=100), cost)     # 3 s: a miss,
    assert long_streams.chosen.action == "wait" and long_streams.chosen.ttft_misses == 1     # fewer than 10
    late = planner.step_budget(state(queue=[Waiting(300, waited=1.2)], remaining=20), cost)
    assert late.chosen.action == "local" and late.chosen.chunk == 300     # past its TTFT SLO: served now
    unknown = planner.step_budget(state(queue=[Waiting(300)]), cost)      # no stream's length known: no wait
    assert {p.action for p in unknown.candidates} == {"local"}
    placed = planner.place(300, 300, state(remaining=20), cost, linear_cost(0.01, 0.0, 0.01))   # remote: 3 s
    assert placed.local and placed.chosen.action == "wait"
    cheaper = planner.place(300, 300, state(remaining=20), cost, linear_cost(0.01, 0.0, 0.0005))
    assert not cheaper.local                       # 0.16 s there, and the streams keep their rhythm


def test_a_batch_already_past_the_itl_slo_is_charged_only_for_what_prefill_adds():
    planner = Planner(Slos(ttft=1.0, itl=0.02), max_prefill_tokens=2048)     # decoding 10 rows alone: 30 ms
    cost = decode_cost()
    waiting = planner.step_budget(state(queue=[Waiting(300)], remaining=20), cost)
    assert waiting.chosen.action == "wait" and waiting.chosen.itl_misses == 0    # the 30 ms steps: no action's fault
    assert all(p.itl_misses == 10 for p in waiting.candidates if p.action == "local")
    remote = planner.place(300, 300, state(), cost, linear_cost(0.01, 0.0, 0.0005))
    assert not remote.local and remote.chosen.misses == 0                     # the streams step as fast as alone
    unknown = planner.step_budget(state(queue=[Waiting(300)]), cost)         # nothing else to do: served now
    assert unknown.chosen.action == "local" and unknown.chosen.chunk == 300


def test_decisions_are_deterministic_for_a_seeded_cost_model():
    def decisions(seed: int) -> list[tuple[str, int]]:
        planner = Planner(SLOS, max_prefill_tokens=1024)
        decode = decode_cost(noise=0.05, seed=seed)
        prefill = linear_cost(0.02, 0.0, 0.0006, noise=0.05, seed=seed)    # a little slower a token
        cases = [(0, 500, state(rows=0)), (30, 30, state()), (400, 400, state()), (400, 400, state(backlog=4000)),
                 (400, 40, state(backlog=300)), (200, 200, state(queue=[Waiting(900, 0.2)]))]
        return [(d.chosen.action, d.chosen.chunk) for d in
                (planner.place(local, remote, s, decode, prefill) for local, remote, s in cases)]

    assert decisions(7) == decisions(7)
    assert [action for action, _ in decisions(7)] == [
        "local",     # nothing decodes: the decode unit on every core
        "remote",    # fits a step, but the idle prefill unit does it alongside: more tokens per second
        "remote",    # 400 tokens: 10 steps at the fitting chunk here, 0.2 s there
        "local",     # the prefill unit is 2 s behind: its first token would miss
        "remote",    # the prefill pool has most of it cached
        "remote"]    # behind a local queue of 900 tokens: there it meets the TTFT SLO


def test_uncached_tokens_decide_where_a_conversations_next_turn_goes():
    planner = Planner(SLOS, max_prefill_tokens=2048)
    prefill = linear_cost(0.01, 0.0, 0.0005)
    assert planner.place(20, 2000, state(), decode_cost(), prefill).local        # its history is cached here
    assert not planner.place(2000, 20, state(), decode_cost(), prefill).local    # it is cached there


def test_before_any_step_is_measured_every_prompt_stays_local_at_the_full_budget():
    planner = Planner(SLOS, max_prefill_tokens=2048)
    decision = planner.place(1500, 1500, state(), StepCostModel(), StepCostModel())
    assert decision.local and decision.chosen.chunk == 2048
    assert planner.step_budget(state(queue=[Waiting(1500)]), StepCostModel()).chosen.chunk == 2048


def test_lending_is_decided_from_the_predicted_step_on_each_thread_count():
    planner = Planner(SLOS, max_prefill_tokens=2048)
    scaling = StepCostModel()                       # two threads: half the time
    for rows, tokens in [(1, 0), (8, 0), (16, 64), (4, 512), (0, 256)]:
        scaling.observe(1, rows, tokens, 0.01 + 0.002 * rows + 0.001 * tokens)
        scaling.observe(2, rows, tokens, (0.01 + 0.002 * rows + 0.001 * tokens) / 2)
    assert planner.lend(scaling, 1, 2, 8, 0, 0, partner_slo=0.05)
    assert not planner.lend(scaling, 1, 2, 0, 512, 0, partner_slo=0.05)      # 0.26 s: the partner would wait past it
    flat = StepCostModel()                          # a tiny step: a second thread only adds its overhead
    for rows in (1, 4, 8, 16):
        flat.observe(1, rows, 0, 0.001)
        flat.observe(2, rows, 0, 0.0015)
    assert not planner.lend(flat, 1, 2, 8, 0, 0, partner_slo=0.05)
    assert planner.lend(StepCostModel(), 1, 2, 8, 0, 0, partner_slo=0.05)    # unmeasured: try it


def test_lending_is_tried_again_once_its_fit_is_older_than_a_fit_remembers():
    """The lent fit learns only from lent steps: measured slow once (a moment of low memory bandwidth, say),
    it would keep a unit on its own cores for good."""
    planner, cost = Planner(SLOS, max_prefill_tokens=2048), StepCostModel()
    for rows in (1, 8, 16, 32):
        cost.observe(2, rows, 0, 0.01 + 0.004 * rows)           # lent steps, measured at a slow moment
        cost.observe(1, rows, 0, 0.01 + 0.003 * rows)
    tried = []
    for _ in range(200):
        lend = planner.lend(cost, 1, 2, 16, 0, 0, partner_slo=1.0)
        tried.append(lend)
        if lend:
            cost.observe(2, 16, 0, 0.01 + 0.0015 * 16)           # as fast as lent steps are now
        else:
            cost.observe(1, 16, 0, 0.01 + 0.003 * 16)
    window = int(1 / (1 - cost.decay))                          # 33 steps
    assert tried.index(True) == window and not any(tried[:window])   # the lent fit is older than own's memory
    assert all(tried[-50:])                                      # a few tries, and it lends from then on


def test_lending_is_tried_at_a_step_larger_than_any_its_fit_remembers():
    """Steps of a few rows do not pin the per-row cost down: a lent fit that had seen only one-row decode steps
    and prefill chunks predicted a 48-row step at 1.5x its measured time, and the unit stepped on its own core."""
    def measured_on_small_steps() -> StepCostModel:
        cost = StepCostModel()
        for _ in range(40):
            for rows in (1, 2, 4):
                cost.observe(2, rows, 0, 0.01 + 0.01 * rows)            # lent: a steep slope over a few rows
            cost.observe(1, 48, 0, 0.057)                               # own core: the full batch
        return cost

    planner, cost = Planner(SLOS, max_prefill_tokens=2048), measured_on_small_steps()
    assert cost.predict(2, 48, 0) > cost.predict(1, 48, 0)             # extrapolated: slower lent
    assert planner.lend(cost, 1, 2, 48, 0, 0, partner_slo=1.0)         # so it is tried
    assert not planner.lend(cost, 1, 2, 4, 0, 0, partner_slo=0.01)     # (the partner's SLO still bounds it)
    for _ in range(5):
        cost.observe(2, 48, 0, 0.037)                                   # as fast as lent 48-row steps are
    assert cost.covers(2, 48, 0) and planner.lend(cost, 1, 2, 48, 0, 0, partner_slo=1.0)
    slow = measured_on_small_steps()
    for _ in range(5):
        slow.observe(2, 48, 0, 0.080)                                   # slower lent, measured now
    assert not planner.lend(slow, 1, 2, 48, 0, 0, partner_slo=1.0)


def test_context_tokens_are_a_coefficient_of_their_own():
    cost = StepCostModel()
    for rows, context in [(1, 100), (8, 800), (8, 8000), (16, 4000), (4, 16000), (2, 200)]:
        cost.observe(None, rows, 0, 0.01 + 0.001 * rows + 0.002 * context / 1000, context=context)
    assert cost.predict(None, 8, 0, context=20_000) == pytest.approx(0.01 + 0.008 + 0.04, rel=0.02)


def test_slo_defaults_are_derived_from_the_measured_steps():
    sched = SchedulerConfig(max_num_seqs=16, max_prefill_tokens=512)
    decode, prefill = StepCostModel(), StepCostModel()
    for rows, context in [(1, 1), (16, 16), (16, 16 * 512), (4, 100)]:
        decode.observe(1, rows, 0, 0.005 + 0.001 * rows + 0.004 * context / 1000, context=context)
    for tokens in (1, 256, 512):
        prefill.observe(1, 0, tokens, 0.02 + 0.0004 * tokens)
    slos = derive_slos(sched, 4096, MeasuredUnits(decode, 1, prefill, 1))
    one_row, ttft_step = 0.005 + 0.001 + 0.004 * 512 / 1000, 0.02 + 0.0004 * 128      # a typical prompt: 512 / 4
    assert slos.itl == pytest.approx(HEADROOM * KNEE * one_row, rel=0.01)      # the knee: a 2.5-row batch here
    assert slos.ttft == pytest.approx(HEADROOM * ttft_step, rel=0.01)
    assert "knee batch" in slos.itl_source and "one-row step at context 512" in slos.itl_source
    assert "first token of a typical 128-token prompt" in slos.ttft_source
    small_batch = derive_slos(SchedulerConfig(max_num_seqs=2, max_prefill_tokens=512), 4096,
                              MeasuredUnits(decode, 1, prefill, 1))
    full_batch = 0.005 + 0.002 + 0.004 * 2 * 512 / 1000                         # below the knee: all of it
    assert small_batch.itl == pytest.approx(HEADROOM * full_batch, rel=0.01)
    assert "a full batch (2 rows" in small_batch.itl_source
    timed = derive_slos(sched, 4096, MeasuredUnits(decode, 1, prefill, 1, one_row_step=0.015,
                                                           typical_prompt_step=0.3))
    assert timed.itl == pytest.approx(HEADROOM * KNEE * 0.015)                  # the profile's own timings
    assert timed.ttft == pytest.approx(HEADROOM * 0.3)
    assert "the 15.0 ms one-row step" in timed.itl_source and "the 300.0 ms first token" in timed.ttft_source
    set_ = derive_slos(SchedulerConfig(ttft_slo_ms=800, itl_slo_ms=40), 4096, None)
    assert (set_.ttft, set_.itl, set_.ttft_source, set_.itl_source) == (0.8, 0.04, "set", "set")
    with pytest.raises(ValueError, match="--itl-slo-ms is not set"):
        derive_slos(SchedulerConfig(ttft_slo_ms=800), 4096, MeasuredUnits(StepCostModel(), 1, prefill, 1))


def test_a_derived_ttft_slo_scales_with_the_prompt_and_a_stated_one_does_not():
    """A document no idle unit could answer within a chat's derived bound is not counted late whatever the planner
    does (it traded every stream's gaps for such prompts); a stated SLO is the operator's, one bound for all."""
    sched = SchedulerConfig(max_num_seqs=16, max_prefill_tokens=512)
    prefill = linear_cost(0.01, 0.0, 0.002)
    derived = derive_slos(sched, 4096, MeasuredUnits(decode_cost(), None, prefill, None, one_row_step=0.015,
                                                     typical_prompt_step=0.5))
    assert derived.ttft == pytest.approx(1.0) and derived.ttft_tokens == 128
    assert [derived.ttft_for(n) for n in (1, 128, 512)] == pytest.approx([1.0, 1.0, 4.0])
    assert "scaled by length past 128 tokens" in derived.describe()
    stated = derive_slos(SchedulerConfig(ttft_slo_ms=1000, itl_slo_ms=50), 4096, None)
    assert stated.ttft_for(100_000) == 1.0 and "scaled" not in stated.describe()
    document = [next(p for p in Planner(slos, max_prefill_tokens=2048).place(
        1000, 1000, state(), decode_cost(), prefill).candidates if p.action == "remote") for slos in (derived, stated)]
    assert document[0].first_token == pytest.approx(2.01, rel=0.05)     # past 1 s, within 1000 / 128 s
    assert (document[0].ttft_misses, document[1].ttft_misses) == (0, 1)


def test_the_slos_are_engine_options_and_the_itl_target_is_gone():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    sched = engine_config_from_args(parser.parse_args([])).scheduler
    assert sched.ttft_slo_ms is None and sched.itl_slo_ms is None
    sched = engine_config_from_args(parser.parse_args(["--ttft-slo-ms", "900", "--itl-slo-ms", "60"])).scheduler
    assert (sched.ttft_slo_ms, sched.itl_slo_ms) == (900.0, 60.0)
    for option in ("--ttft-slo-ms", "--itl-slo-ms"):
        with pytest.raises(ValueError, match=f"{option} must be positive"):
            engine_config_from_args(parser.parse_args([option, "0"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--itl-target-ms", "50"])
    assert sched.startup_profile                       # the cost models start measured, SLOs stated or not
    quick = ["--ttft-slo-ms", "900", "--itl-slo-ms", "60", "--no-startup-profile"]
    assert not engine_config_from_args(parser.parse_args(quick)).scheduler.startup_profile
    with pytest.raises(ValueError, match="--no-startup-profile needs --ttft-slo-ms and --itl-slo-ms"):
        engine_config_from_args(parser.parse_args(quick[2:]))


def test_the_profile_measures_a_full_batch_in_small_step_messages():
    sched = SchedulerConfig(max_num_seqs=256, max_prefill_tokens=4096)
    shapes = profile_shapes(sched, 8192, decodes=True, prefills=True)
    assert all(s.num_seqs * (s.context + s.new_tokens) <= MESSAGE_TOKENS + s.num_seqs * 1 for s in shapes
               if s.kind == "decode")
    assert {(s.num_seqs, s.context) for s in shapes if s.kind == "decode"} == {(1, 1), (256, 1), (1, 4096), (256, 64)}
    assert [(s.new_tokens, s.context) for s in shapes if s.kind == "prefill"] == [(1, 0), (1024, 0), (2048, 0),
                                                                                  (1024, 3072)]
    assert not [s for s in profile_shapes(sched, 8192, decodes=False, prefills=True) if s.kind == "decode"]


def test_a_remote_prefill_is_predicted_while_the_decode_units_own_cores_are_unmeasured():
    """A served load crashed the decode actor: its steps had all run on borrowed cores, its own thread count
    was seen once, and the remote candidate's decode step at it was None (TypeError in the planner)."""
    cost = decode_cost(threads=(2,))
    cost.observe(1, 4, 0, 0.5)                        # one step on its own thread: not a fit yet
    assert cost.predict(1, 10, 0) is None
    idle_prefill = LoadState(10, (), 0, decode_threads=1, decode_threads_alone=2, prefill_threads=1,
                             prefill_busy=False)
    decision = Planner(SLOS, max_prefill_tokens=2048).place(1000, 1000, idle_prefill, cost,
                                                            linear_cost(0.01, 0.0, 0.0005))
    remote = next(p for p in decision.candidates if p.action == "remote")
    assert remote.step == pytest.approx(cost.predict(2, 10, 0))     # as the decode unit steps now


def test_a_prefill_rate_is_measured_only_once_three_steps_carried_prefill():
    cost = StepCostModel()
    for rows in range(1, 11):
        cost.observe(2, rows, 0, 0.01 + 0.001 * rows)        # decode-only steps: no prefill seen
    cost.observe(2, 4, 70, 0.05)
    cost.observe(2, 4, 30, 0.03)
    assert cost.coefficients(2) is not None and cost.seconds_per_prefill_token(2) is None
    cost.observe(2, 4, 50, 0.04)
    assert cost.seconds_per_prefill_token(2) == pytest.approx(0.0005, rel=0.2)
    assert cost.seconds_per_prefill_token(1) == cost.seconds_per_prefill_token(2)    # unmeasured: the most threads


def attention_cost(per_pair: float = 0.02, seed: int = 0, overrun: float = 1.0) -> StepCostModel:
    """decode_cost's steps plus `per_pair` seconds a million attention pairs, fed chunks at random offsets into
    their prompts; with `overrun`, every other step that decodes and prefills in the last 40 runs that much
    longer."""
    rng, cost = random.Random(seed), StepCostModel()
    for step in range(100):
        rows, tokens, start = rng.randrange(0, 32), rng.choice([0, 16, 64, 256, 512]), rng.choice([0, 0, 512, 1536])
        pairs = attention_pairs(start, tokens) if tokens else 0
        seconds = 0.02 + 0.001 * rows + 0.0005 * tokens + per_pair * pairs / 1e6
        late = overrun if step >= 60 and rows and tokens and step % 2 else 1.0
        cost.observe(None, rows, tokens, seconds * late, pairs=pairs)
    return cost


def test_a_chunk_deep_into_its_prompt_is_priced_by_the_attention_pairs_it_reads():
    cost = attention_cost()
    truth = 0.02 + 0.001 * 10 + 0.0005 * 300 + 0.02 * attention_pairs(1700, 300) / 1e6
    assert cost.predict(None, 10, 300, pairs=attention_pairs(1700, 300)) == pytest.approx(truth, rel=0.02)
    assert cost.predict(None, 10, 300) < truth                   # the same chunk as its prompt's first
    first, deep = (cost.chunk_within(None, 0.1, 10, 0, start, 2048) for start in (0, 1700))
    assert deep < first
    for start, chunk in ((0, first), (1700, deep)):              # the largest chunk whose step keeps 100 ms
        fits = [cost.predict(None, 10, n, pairs=attention_pairs(start, n)) for n in (chunk, chunk + 1)]
        assert fits[0] <= 0.1 < fits[1]
    assert cost.chunk_within(None, 0.1, 10, 0, 0, 100) == 100    # at most `most`
    assert cost.chunk_within(None, 0.02, 10, 0, 0, 2048) == 0    # decoding alone is past the limit


def test_chunks_that_keep_the_itl_slo_shrink_as_they_reach_deeper_into_their_prompt():
    planner, cost = Planner(Slos(ttft=5.0, itl=0.1, itl_kind="max"), max_prefill_tokens=2048), attention_cost()
    fresh = planner.step_budget(state(queue=[Waiting(2000)], remaining=64), cost)
    deep = planner.step_budget(state(queue=[Waiting(500, length=2000)], remaining=64), cost)
    fitting = [next(p for p in d.candidates if p.action == "local" and p.chunk < 2000) for d in (fresh, deep)]
    assert fitting[1].chunk < fitting[0].chunk
    assert all(p.itl_misses == 0 and p.step <= 0.1 for p in fitting)     # each of their steps within the SLO
    assert fresh.chosen is fitting[0] and deep.chosen is fitting[1]       # the whole prompt: a 1 s step, 10 misses
    assert fitting[1].chunk == cost.chunk_within(None, 0.1 / cost.overrun(None), 10, 0, 1500, 2048)
    seconds, start = 0.0, 0                           # the runner's steps: each decision's chunk at its offset
    while start < 2000:
        chunk = min(2000 - start, cost.chunk_within(None, 0.1 / cost.overrun(None), 10, 0, start, 2048))
        seconds += cost.predict(None, 10, chunk, pairs=attention_pairs(start, chunk))
        start += chunk
    assert fitting[0].first_token == pytest.approx(seconds, rel=0.02)


def test_with_every_gap_counted_a_chunk_keeps_the_margin_its_fits_recent_errors_show():
    cost = attention_cost(overrun=1.3)
    assert 1.2 < cost.overrun(None) < 1.4          # the worst of its last steps that decoded and prefilled
    queue = [Waiting(1000)]
    chunks = {kind: Planner(Slos(ttft=5.0, itl=0.1, itl_kind=kind), 2048).step_budget(
        state(queue=queue, remaining=64), cost) for kind in ("mean", "max")}
    mean, most = (next(p for p in chunks[kind].candidates if p.action == "local" and p.chunk < 1000)
                  for kind in ("mean", "max"))
    assert most.chunk < mean.chunk
    assert cost.predict(None, 10, most.chunk) * cost.overrun(None) <= 0.1 < cost.predict(None, 10, mean.chunk) * 1.3
    assert attention_cost().overrun(None) == pytest.approx(1.0, abs=0.01)      # a fit that holds: no margin


def test_a_prefill_step_that_ran_past_its_prediction_sets_the_margin_before_any_step_decodes_beside_one():
    """A chunk sized to every gap's bound must keep the margin the lagging cores showed on the prompts prefilled
    alone, before the first step that decodes beside a chunk overruns (and misses the bound)."""
    cost = StepCostModel()
    for step in range(40):
        tokens = (16, 64, 256)[step % 3]
        cost.observe(None, 0, tokens, (0.02 + 0.0005 * tokens) * (1.25 if step >= 30 else 1.0))
    for step in range(10):
        cost.observe(None, 1 + step % 4, 0, 0.02 + 0.001 * (1 + step % 4))
    assert 1.1 < cost.overrun(None) < 1.3


def test_a_prompts_attention_pairs_are_the_same_however_it_is_chunked():
    """What the planner's fitting plan rests on: chunking moves a prompt's attention work between steps, it does
    not change it."""
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randrange(2, 3000)
        cuts = sorted(rng.sample(range(1, n), rng.randrange(1, min(n - 1, 12) + 1)))
        chunks = [ScheduledChunk(None, start, stop - start, False) for start, stop in zip([0, *cuts], [*cuts, n])]
        assert Batch(chunks=tuple(chunks)).chunk_pairs == attention_pairs(0, n)
    assert attention_pairs(3, 4) == sum(position + 1 for position in range(3, 7))    # each query and its keys


def test_equal_misses_go_to_the_earliest_first_token_not_the_most_tokens_per_second():
    """No candidate misses an SLO: the chat prompt starts in the decode unit's next step (a 0.4 s step the streams
    have slack for) rather than on a slower prefill unit that keeps more tokens flowing meanwhile, which the rule
    before took for its throughput and answered twice as late."""
    planner = Planner(Slos(ttft=2.0, itl=0.3), 2048)
    decode, prefill = linear_cost(0.005, 0.0005, 0.001), linear_cost(0.05, 0.0, 0.002)
    busy = LoadState(8, (), 0, decode_remaining=8, streams=(Stream(remaining=8),) * 8)
    decision = planner.place(400, 400, busy, decode, prefill)
    assert all(c.misses == 0 for c in decision.candidates)
    remote = next(c for c in decision.candidates if c.action == "remote")
    assert remote.tokens_per_second > decision.chosen.tokens_per_second
    assert decision.local and decision.chosen.chunk == 400
    assert decision.chosen.first_token == pytest.approx(0.409, rel=0.05)
    assert decision.chosen.first_token < remote.first_token / 2


def test_a_short_prompt_starts_in_the_next_step_where_no_stream_is_pushed_past_its_slo():
    planner = Planner(Slos(ttft=2.0, itl=0.1), 2048)
    decode, prefill = linear_cost(0.02, 0.0005, 0.001), linear_cost(0.01, 0.0, 0.002)
    streams = LoadState(16, (), 0, decode_remaining=8, streams=(Stream(remaining=8),) * 16)
    decision = planner.place(100, 100, streams, decode, prefill)
    now = next(c for c in decision.candidates if c.action == "local" and c.chunk == 100)
    assert now.misses == 0 and decision.chosen is now                  # one 128 ms step: the 100 ms mean holds
    assert now.first_token < min(c.first_token for c in decision.candidates if c is not now)
    assert max(decision.candidates, key=lambda c: c.tokens_per_second).action == "remote"   # the rule before's pick


def test_one_slow_lent_step_does_not_decide_every_lending_after_it():
    """A 512-token prompt's first lent step ran 933 ms where lent ones run ~550 and one-core ones ~800 (its first
    time at that shape, or the machine's noise): the fit then predicted one core faster, and the next prompt of
    that size ran on one core. One remembered step at a shape is not enough to stop trying it."""
    cost = StepCostModel()
    for _ in range(60):
        cost.observe(2, 1, 0, 0.008)                                     # lent one-row decode steps
    for _ in range(4):
        cost.observe(1, 0, 512, 0.80)                                    # one-core prompt steps
        cost.observe(1, 1, 0, 0.012)
    cost.observe(2, 0, 512, 0.933)                                       # the one slow lent prompt step
    planner = Planner(SLOS, max_prefill_tokens=2048)
    assert cost.predict(2, 0, 512) > cost.predict(1, 0, 512)            # the fit now says one core is faster
    assert not cost.covers(2, 0, 512)
    assert planner.lend(cost, 1, 2, 0, 512, 0, partner_slo=10.0)         # so lending is tried again
    cost.observe(2, 0, 512, 0.55)                                        # as fast as lent prompt steps are
    assert cost.covers(2, 0, 512) and planner.lend(cost, 1, 2, 0, 512, 0, partner_slo=10.0)
    served = StepCostModel()
    served.learn_from(cost)          # a start-up profile's errors were against its own half-grown fit: not kept
    assert served.overrun(None) == 1.0 and served.predict(None, 0, 64) == cost.predict(None, 0, 64)
