"""Per-request load-test records and the summary arithmetic (vLLM `bench serve` names).

Times in records are seconds; summary latencies are milliseconds.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

SLO_METRICS = ("ttft", "itl", "tpot", "e2el")   # itl: the request's largest inter-token gap
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "short_itl")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
    "short_itl": "Inter-token Latency, short streams",
}
METRIC_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL", "short_itl": "short ITL"}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did. `send_time` is seconds after the benchmark started.

    `itl` holds one gap per streamed chunk that carries a token, after the first (a
    token whose text completes no character yet counts, as in vLLM's bench). `output_tokens`
    comes from the server's usage report when `usage_reported`, else it is the
    number of such chunks.
    """

    index: int
    kind: str
    prompt_len: int
    max_tokens: int
    send_time: float
    success: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: tuple[float, ...] = ()
    finish_reason: str | None = None
    usage_reported: bool = False
    cached_tokens: int = 0          # usage.prompt_tokens_details.cached_tokens
    conversation: int = -1          # multi-turn chat: which conversation, and its 1-based turn
    turn: int = 0

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None with fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.usage_reported else self.prompt_len

    def to_json(self) -> dict:
        return asdict(self) | {"tpot": self.tpot, "itl": list(self.itl)}

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**fields | {"itl": tuple(data.get("itl", ()))})


@dataclass(frozen=True, slots=True)
class BenchResult:
    """A run's records, its duration (s), the server's prefix-cache counters over it
    (bench.server_metrics.prefix_cache_delta; None when the server exports none) and the
    time.perf_counter() its records' send times count from."""

    records: tuple[RequestRecord, ...]
    duration: float
    prefix_cache: dict | None = None
    origin: float = 0.0
    spec_decode: dict | None = None     # bench.server_metrics.spec_decode_delta; None when the server has none


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    Raises ValueError on an empty sequence or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean, median, std (population) and each pNN of `values`; zeros when there are none."""
    percentiles = tuple(percentiles)
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0} | {_pname(p): 0.0 for p in percentiles}
    mean = _mean(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    stats = {"mean": mean, "median": percentile(values, 50), "std": std}
    return stats | {_pname(p): percentile(values, p) for p in percentiles}


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _pname(p: float) -> str:
    return f"p{p:g}"


def parse_slo(items: Iterable[str]) -> dict[str, float]:
    """`["ttft_ms=500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    Raises ValueError on an unknown metric, a malformed item or a non-positive bound.
    """
    slo = {}
    for item in items:
        key, sep, value = item.replace(":", "=").partition("=")
        name = key.strip().removesuffix("_ms")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}: use NAME_ms=VALUE with NAME in {', '.join(SLO_METRICS)}")
        slo[name] = float(value)
        if not slo[name] > 0:
            raise ValueError(f"bad SLO {item!r}: the bound must be positive")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """True when a successful request is within every bound in `slo` (ms); `itl` bounds every one of its
    inter-token gaps (a stall of one step misses it, however smooth the rest of the stream)."""
    observed = {"ttft": record.ttft, "itl": max(record.itl, default=0.0), "tpot": record.tpot or 0.0,
                "e2el": record.latency}
    return record.success and all(observed[name] * 1000.0 <= bound for name, bound in slo.items())


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Each latency metric's samples in ms over successful requests."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft * 1000.0 for r in ok],
        "tpot": [r.tpot * 1000.0 for r in ok if r.tpot is not None],
        "itl": [gap * 1000.0 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1000.0 for r in ok],
        "short_itl": [gap * 1000.0 for r in ok if r.kind == "short" for gap in r.itl],
    }


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    slo: dict[str, float] | None = None,
    percentiles: Iterable[float] = (90, 99),
    metrics: Iterable[str] = LATENCY_METRICS,
) -> dict:
    """The benchmark summary: counts, throughputs, goodput and latency distributions.

    Keys follow vLLM: `request_throughput`, `output_throughput`, `mean_ttft_ms`,
    `p99_itl_ms`, ...; `request_goodput` is None without an SLO.
    Raises ValueError if `duration` is not positive.
    """
    if not duration > 0:
        raise ValueError("duration must be positive")
    ok = [r for r in records if r.success]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "completed_short": sum(r.kind == "short" for r in ok),
        "completed_long": sum(r.kind == "long" for r in ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_without_usage": sum(not r.usage_reported for r in ok),
        "mean_input_tokens_short": _mean([r.input_tokens for r in ok if r.kind == "short"]),
        "mean_input_tokens_long": _mean([r.input_tokens for r in ok if r.kind == "long"]),
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(meets_slo(r, slo) for r in ok) / duration if slo else None,
        "slo_attainment": sum(meets_slo(r, slo) for r in ok) / len(records) if slo and records else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": dict(Counter(r.error for r in records if not r.success).most_common()),
        "slo_ms": dict(slo or {}),
    }
    samples = latency_samples(records)
    for name in metrics:
        for stat, value in distribution(samples[name], percentiles).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def format_summary(summary: dict, percentiles: Iterable[float] = (90, 99),
                   title: str = "Serving Benchmark Result") -> str:
    """The summary as vLLM's fixed-width result table."""
    rows = [
        ("Successful requests:", summary["completed"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", f"{summary['duration']:.2f}"),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total generated tokens:", summary["total_output_tokens"]),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
    ]
    rows.append(("Request goodput (req/s):", _goodput_cell(summary)))
    rows.append(("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"))
    rows.append(("Total Token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"))
    lines = [f"{f' {title} ':=^50}"] + [f"{label:<40}{value:<10}" for label, value in rows]
    for name in LATENCY_METRICS:
        if f"mean_{name}_ms" in summary:
            lines.append(f"{METRIC_TITLES[name]:-^50}")
            lines += [f"{label:<40}{summary[key]:<10.2f}" for label, key in _metric_rows(name, percentiles)]
    lines += [f"error x{count}: {error}" for error, count in summary["errors"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)


def _goodput_cell(summary: dict) -> str:
    """Goodput and the share of requests meeting the SLO, or why there is none (no --slo given)."""
    if summary.get("request_goodput") is None:
        return "n/a (no --slo, e.g. --slo ttft_ms=500 itl_ms=100)"
    slo = " ".join(f"{name}_ms={bound:g}" for name, bound in summary["slo_ms"].items())
    return f"{summary['request_goodput']:.2f} ({summary['slo_attainment']:.0%} within {slo})"


def _metric_rows(name: str, percentiles: Iterable[float]) -> list[tuple[str, str]]:
    label = METRIC_LABELS[name]
    rows = [(f"Mean {label} (ms):", f"mean_{name}_ms"), (f"Median {label} (ms):", f"median_{name}_ms")]
    return rows + [(f"P{p:g} {label} (ms):", f"{_pname(p)}_{name}_ms") for p in percentiles]


COMPARISON_ROWS = (
    ("mean prompt tokens, short streams", "mean_input_tokens_short"),
    ("mean prompt tokens, long prompts", "mean_input_tokens_long"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("goodput (req/s)", "request_goodput"),
    ("requests within the SLO (share)", "slo_attainment"),
) + tuple(
    (f"{stat} {label} (ms)", f"{stat}_{name}_ms")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("short_itl", "short-stream ITL"),
                        ("e2el", "E2E latency"))
    for stat in ("mean", "median", "p90", "p99")
)


ALWAYS_SHOWN = ("request_goodput",)    # "-" in every column without --slo: the reader sees it was not asked


def markdown_comparison(columns: Sequence[tuple[str, dict | None, float]]) -> str:
    """A Markdown table with one column per (title, summary or None if it failed, start-up seconds)."""
    def row(label: str, cells: Iterable[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    summaries = [summary or {} for _, summary, _ in columns]
    lines = [row("metric", (title for title, _, _ in columns)), "|---|" + "---:|" * len(columns),
             row("status", ("ok" if s.get("completed") else "**failed**" for s in summaries)),
             row("requests ok / failed", (f"{s['completed']} / {s['failed']}" if s else "-" for s in summaries)),
             row("server start-up (s)", (f"{t:.1f}" if s else "-" for s, (_, _, t) in zip(summaries, columns)))]
    for label, key in COMPARISON_ROWS:
        if any(s.get(key) is not None for s in summaries) or key in ALWAYS_SHOWN:
            lines.append(row(label, ("-" if s.get(key) is None else f"{s[key]:.2f}" for s in summaries)))
    return "\n".join(lines)
