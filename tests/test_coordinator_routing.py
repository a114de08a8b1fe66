"""The router on synthetic unit state: earliest predicted first token, prefix hits, KV room, determinism."""
from __future__ import annotations

import random

from pdserve.engine.coordinator.routing import DecodeView, PrefillView, decode_order, first_token_order


def random_prefill_views(rng: random.Random, n: int, measured: bool) -> list[PrefillView]:
    return [PrefillView(i, rng.randint(0, 4000), rng.randint(1, 2000),
                        rng.uniform(1e-5, 1e-3) if measured else None, up=rng.random() > 0.2) for i in range(n)]


def test_the_same_state_routes_the_same_way_and_follows_the_predicted_first_token():
    rng = random.Random(7)
    for _ in range(200):
        measured = rng.random() < 0.5
        views = random_prefill_views(rng, rng.randint(1, 8), measured)
        order = first_token_order(views)
        assert order == first_token_order(list(views)) == first_token_order(list(reversed(views)))
        live = [v for v in views if v.up]
        assert sorted(order) == [v.index for v in live]

        def wait(v):
            return (v.queued_tokens + v.uncached_tokens) * (v.seconds_per_token if measured else 1)

        waits = [wait(views[i]) for i in order]
        assert waits == sorted(waits)


def test_ties_go_to_the_lowest_unit_index_and_a_down_unit_gets_nothing():
    views = [PrefillView(i, 100, 50, None) for i in range(4)]
    assert first_token_order(views) == [0, 1, 2, 3]
    views[0] = PrefillView(0, 100, 50, None, up=False)
    assert first_token_order(views) == [1, 2, 3]
    assert first_token_order([PrefillView(0, 0, 1, None, up=False)]) == []


def test_prefix_hits_send_a_turn_to_the_unit_holding_its_history_unless_its_queue_outweighs_them():
    holder, other = PrefillView(0, 300, 40, None), PrefillView(1, 0, 640, None)
    assert first_token_order([other, holder])[0] == 0            # 340 tokens to wait there vs 640
    busier = PrefillView(0, 700, 40, None)
    assert first_token_order([other, busier])[0] == 1


def test_measured_rates_weigh_queues_in_seconds_and_an_unmeasured_unit_falls_back_to_tokens():
    fast, slow = PrefillView(0, 1000, 100, 1e-4), PrefillView(1, 100, 100, 1e-2)
    assert first_token_order([fast, slow]) == [0, 1]             # 0.11 s vs 2 s
    unmeasured = PrefillView(1, 100, 100, None)
    assert first_token_order([fast, unmeasured]) == [1, 0]       # tokens: 1100 vs 200


def test_decode_units_by_step_time_after_the_sequence_then_cached_prefix_then_index():
    views = [DecodeView(0, 5, 0.030), DecodeView(1, 3, 0.020), DecodeView(2, 3, 0.020, cached_blocks=4),
             DecodeView(3, 1, 0.010, up=False)]
    assert decode_order(views) == [2, 1, 0]
    rows_only = [DecodeView(0, 5, None), DecodeView(1, 3, 0.5), DecodeView(2, 3, None)]
    assert decode_order(rows_only) == [1, 2, 0]                   # one unmeasured: all by rows
    rng = random.Random(3)
    for _ in range(100):
        views = [DecodeView(i, rng.randint(1, 9), rng.choice([None, rng.uniform(0.01, 0.1)]), rng.randint(0, 3),
                            rng.random() > 0.2) for i in range(rng.randint(1, 6))]
        assert decode_order(views) == decode_order(list(reversed(views)))
