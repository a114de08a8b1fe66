"""bench/metrics.py: percentile arithmetic against numpy, TPOT, throughput and goodput
on hand-made request timelines."""
from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.metrics import (
    RequestRecord,
    distribution,
    format_summary,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
)


@pytest.mark.parametrize("size", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(size):
    rng = np.random.default_rng(size)
    values = rng.lognormal(mean=3.0, sigma=1.0, size=size).tolist()
    for q in [0, 1, 25, 50, 90, 99, 99.9, 100, *rng.uniform(0, 100, 5)]:
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_matches_numpy():
    values = np.random.default_rng(0).exponential(20.0, size=333).tolist()
    stats = distribution(values, (90, 99, 99.9))
    assert stats["mean"] == pytest.approx(np.mean(values))
    assert stats["median"] == pytest.approx(np.median(values))
    assert stats["std"] == pytest.approx(np.std(values))
    assert stats["p99.9"] == pytest.approx(np.percentile(values, 99.9))
    assert distribution([], (99,)) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def _record(index, kind="short", ttft=0.1, itl=(0.02, 0.03, 0.05), output_tokens=4, send=0.0, **kw) -> RequestRecord:
    latency = ttft + sum(itl)
    fields = dict(index=index, kind=kind, prompt_len=100, max_tokens=output_tokens, send_time=send, success=True,
                  prompt_tokens=97, output_tokens=output_tokens, ttft=ttft, latency=latency, itl=tuple(itl),
                  finish_reason="length", usage_reported=True)
    return RequestRecord(**fields | kw)


def test_tpot_is_decode_time_per_token_after_the_first():
    record = _record(0, ttft=0.25, itl=(0.1, 0.2, 0.3, 0.4), output_tokens=5)
    assert record.tpot == pytest.approx((1.25 - 0.25) / 4)
    # usage may count more tokens than content chunks (merged chunks): TPOT uses usage
    merged = _record(1, ttft=0.2, itl=(0.3,), output_tokens=7)
    assert merged.tpot == pytest.approx(0.3 / 6)
    assert _record(2, itl=(), output_tokens=1).tpot is None


def _timeline() -> list[RequestRecord]:
    return [
        _record(0, ttft=0.100, itl=(0.020, 0.030, 0.050), send=0.0),
        _record(1, ttft=0.400, itl=(0.010, 0.500), output_tokens=3, send=0.5),
        _record(2, kind="long", ttft=1.500, itl=(0.040,) * 7, output_tokens=8, send=1.0, prompt_tokens=900),
        _record(3, ttft=0.050, itl=(), output_tokens=1, send=1.5, usage_reported=False, prompt_tokens=0),
        RequestRecord(4, "short", 100, 4, 2.0, success=False, error="HTTP 500: boom"),
        RequestRecord(5, "long", 1000, 4, 2.5, success=False, error="HTTP 500: boom"),
        RequestRecord(6, "short", 100, 4, 3.0, success=False, error="stream ended without [DONE]"),
    ]


def test_summary_counts_throughput_and_distributions():
    records = _timeline()
    summary = summarize(records, duration=4.0, percentiles=(90, 99))
    assert (summary["completed"], summary["failed"]) == (4, 3)
    assert (summary["completed_short"], summary["completed_long"]) == (3, 1)
    assert summary["total_input_tokens"] == 97 + 97 + 900 + 100  # record 3 has no usage: its estimate
    assert summary["total_output_tokens"] == 4 + 3 + 8 + 1
    assert summary["requests_without_usage"] == 1
    assert (summary["mean_input_tokens_short"], summary["mean_input_tokens_long"]) == ((97 + 97 + 100) / 3, 900)
    assert summary["request_throughput"] == pytest.approx(4 / 4.0)
    assert summary["output_throughput"] == pytest.approx(16 / 4.0)
    assert summary["total_token_throughput"] == pytest.approx((1194 + 16) / 4.0)
    assert summary["request_goodput"] is None
    assert summary["errors"] == {"HTTP 500: boom": 2, "stream ended without [DONE]": 1}

    ttft_ms = [100.0, 400.0, 1500.0, 50.0]
    itl_ms = [20.0, 30.0, 50.0, 10.0, 500.0] + [40.0] * 7
    short_itl_ms = [20.0, 30.0, 50.0, 10.0, 500.0]
    tpot_ms = [100.0 / 3, 510.0 / 2, 280.0 / 7]
    e2el_ms = [200.0, 910.0, 1780.0, 50.0]
    for name, values in [("ttft", ttft_ms), ("itl", itl_ms), ("short_itl", short_itl_ms),
                         ("tpot", tpot_ms), ("e2el", e2el_ms)]:
        assert summary[f"mean_{name}_ms"] == pytest.approx(np.mean(values)), name
        assert summary[f"median_{name}_ms"] == pytest.approx(np.median(values)), name
        assert summary[f"p90_{name}_ms"] == pytest.approx(np.percentile(values, 90)), name
        assert summary[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99)), name


def test_goodput_counts_successes_meeting_every_slo():
    records = _timeline()
    # ttft <= 450 ms keeps 0, 1, 3; tpot <= 50 ms drops 1 (255 ms); 3 has one token (no TPOT): kept
    summary = summarize(records, duration=4.0, slo=parse_slo(["ttft_ms=450", "tpot_ms=50"]))
    assert summary["request_goodput"] == pytest.approx(2 / 4.0)
    assert summary["slo_ms"] == {"ttft": 450.0, "tpot": 50.0}
    # e2el alone: 200, 910, 1780, 50 ms against 1000 ms
    assert summarize(records, 2.0, slo={"e2el": 1000.0})["request_goodput"] == pytest.approx(3 / 2.0)
    assert not meets_slo(records[4], {"ttft": 1e9})  # a failure never counts


def test_itl_slo_bounds_every_gap_of_a_stream_and_goodput_is_in_the_summary_line():
    smooth = _record(0, ttft=0.1, itl=(0.04,) * 10, output_tokens=11)
    stalled = _record(1, ttft=0.1, itl=(0.01,) * 9 + (0.3,), output_tokens=11)   # lower TPOT, one stall
    assert stalled.tpot < smooth.tpot
    slo = parse_slo(["ttft_ms=200", "itl_ms=100"])
    assert meets_slo(smooth, slo) and not meets_slo(stalled, slo)
    summary = summarize([smooth, stalled], duration=2.0, slo=slo)
    assert summary["request_goodput"] == pytest.approx(0.5) and summary["slo_attainment"] == pytest.approx(0.5)
    line = "Request goodput (req/s):".ljust(40) + "0.50 (50% within ttft_ms=200 itl_ms=100)"
    assert line in format_summary(summary).splitlines()
    assert "n/a (no --slo" in format_summary(summarize([smooth], duration=1.0))


def test_parse_slo_forms_and_errors():
    assert parse_slo(["ttft_ms=500", "tpot:50", "e2el_ms=2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_slo(["itl_ms=100"]) == {"itl": 100.0}
    for bad in (["p50_ms=5"], ["ttft_ms"], ["ttft_ms=-1"], ["ttft_ms=abc"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_summary_rejects_zero_duration_and_handles_all_failed():
    with pytest.raises(ValueError):
        summarize(_timeline(), 0.0)
    failed = [r for r in _timeline() if not r.success]
    summary = summarize(failed, 1.0)
    assert summary["completed"] == 0 and summary["mean_ttft_ms"] == 0.0 and summary["output_throughput"] == 0.0


def test_record_json_round_trip_and_summary_table():
    records = _timeline()
    for record in records:
        data = record.to_json()
        assert data["tpot"] == record.tpot
        assert RequestRecord.from_json(data) == record
    table = format_summary(summarize(records, 4.0, slo={"ttft": 450.0}))
    assert f"{'Successful requests:':<40}4 " in table
    assert f"{'Failed requests:':<40}3 " in table
    assert f"{'Request goodput (req/s):':<40}0.75 " in table
    assert "P99 short ITL (ms):" in table and "Median TTFT (ms):" in table
    assert "error x2: HTTP 500: boom" in table


def test_token_emission_times_for_the_itl_strip():
    from pdserve.bench.plot import token_times

    record = _record(0, ttft=0.5, itl=(0.1, 0.2, 0.05), send=1.0)
    times = token_times(record)
    assert [t for t, _ in times] == pytest.approx([1.6, 1.8, 1.85])
    assert [ms for _, ms in times] == pytest.approx([100.0, 200.0, 50.0])
    assert token_times(_record(1, itl=(), output_tokens=1)) == []
