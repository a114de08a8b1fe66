"""Multi-turn and prefix-cache figures of a run: TTFT per turn index, cached prompt tokens (from
each response's usage) and the server's prefix-cache hit rate (from its /metrics)."""
from __future__ import annotations

from collections.abc import Sequence

from pdserve.bench.metrics import RequestRecord, distribution

TURN_PERCENTILES = (50, 90)


def turn_summary(records: Sequence[RequestRecord], prefix_cache: dict | None) -> dict:
    """Summary keys for the multi-turn and prefix-cache figures.

    `turns` maps each turn index (1-based, as a string) to its counts, p50/p90 TTFT (ms) and mean
    prompt and cached tokens; `median_ttft_later_turns_ms` pools every turn >= 2. Turn keys are
    present only when the records come from the multi-turn workload. `prefix_cache` holds the
    server's counters over the run, per actor (each actor of a disaggregated server looks every
    prompt up in its own pool); `prefix_cache_hit_rate` sums them over the actors. Both are None
    when the server exports no prefix-cache counters.
    """
    ok = [r for r in records if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in ok if r.usage_reported)
    cached = sum(r.cached_tokens for r in ok)
    summary = {
        "prefix_cache": prefix_cache,
        "prefix_cache_hit_rate": prefix_cache["hit_rate"] if prefix_cache else None,
        "cached_prompt_tokens": cached,
        "cached_prompt_token_share": cached / prompt_tokens if prompt_tokens else None,
    }
    turns = sorted({r.turn for r in records if r.turn > 0})
    if turns:
        summary["turns"] = {str(turn): _turn(records, turn) for turn in turns}
        later = _ttft_ms([r for r in ok if r.turn >= 2])
        summary |= {f"{_stat(p)}_ttft_later_turns_ms": v for p, v in _percentiles(later).items()}
        summary |= {f"{_stat(p)}_ttft_turn1_ms": v for p, v in _percentiles(_ttft_ms(
            [r for r in ok if r.turn == 1])).items()}
    return summary


def _turn(records: Sequence[RequestRecord], turn: int) -> dict:
    of_turn = [r for r in records if r.turn == turn]
    ok = [r for r in of_turn if r.success]
    stats = {f"{_stat(p)}_ttft_ms": v for p, v in _percentiles(_ttft_ms(ok)).items()}
    return {"completed": len(ok), "failed": len(of_turn) - len(ok), **stats,
            "mean_prompt_tokens": _mean([r.prompt_tokens for r in ok]),
            "mean_cached_tokens": _mean([r.cached_tokens for r in ok])}


def _ttft_ms(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft * 1000.0 for r in records]


def _percentiles(values: list[float]) -> dict[float, float | None]:
    if not values:
        return {p: None for p in TURN_PERCENTILES}
    stats = distribution(values, TURN_PERCENTILES)
    return {p: stats[f"p{p:g}"] for p in TURN_PERCENTILES}


def _stat(p: float) -> str:
    return "median" if p == 50 else f"p{p:g}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def format_turns(summary: dict) -> str:
    """The per-turn TTFT table and the prefix-cache lines, for the end of the summary print-out."""
    lines = [f"{' Multi-turn chat and prefix cache ':-^66}"]
    if "turns" in summary:
        lines.append(f"{'turn':>4} {'ok':>5} {'failed':>6} {'P50 TTFT ms':>12} {'P90 TTFT ms':>12} "
                     f"{'prompt tok':>11} {'cached tok':>11}")
        for turn, row in summary["turns"].items():
            lines.append(f"{turn:>4} {row['completed']:>5} {row['failed']:>6} {_ms(row['median_ttft_ms']):>12} "
                         f"{_ms(row['p90_ttft_ms']):>12} {row['mean_prompt_tokens']:>11.1f} "
                         f"{row['mean_cached_tokens']:>11.1f}")
        lines.append(f"{'Median TTFT, turns >= 2 (ms):':<40}{_ms(summary['median_ttft_later_turns_ms'])}")
    lines.append(f"{'Prefix cache hit rate (server):':<40}{_actor_rates(summary.get('prefix_cache'))}")
    lines.append(f"{'Cached prompt tokens (usage):':<40}{summary['cached_prompt_tokens']} "
                 f"({_share(summary['cached_prompt_token_share'])})")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def markdown_turns(columns: Sequence[tuple[str, dict | None]]) -> str:
    """A Markdown table of the per-turn TTFT and prefix-cache figures, one column per (title, summary or None)."""
    summaries = [summary or {} for _, summary in columns]
    turns = sorted({int(t) for s in summaries for t in s.get("turns", {})})
    rows = [(f"turn {t} {stat} TTFT (ms)", lambda s, t=t, key=key: _ms(s.get("turns", {}).get(str(t), {}).get(key)))
            for t in turns for stat, key in (("median", "median_ttft_ms"), ("p90", "p90_ttft_ms"))]
    if turns:
        rows.append(("median TTFT, turns >= 2 (ms)", lambda s: _ms(s.get("median_ttft_later_turns_ms"))))
    rows += [("prefix cache hit rate per actor (server /metrics)", lambda s: _actor_rates(s.get("prefix_cache"))),
             ("cached prompt tokens (usage)", lambda s: _cached(s))]
    lines = ["| multi-turn, prefix cache | " + " | ".join(title for title, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(cell(s) if s else "-" for s in summaries) + " |" for label, cell in rows]
    return "\n".join(lines)


def _actor_rates(prefix_cache: dict | None) -> str:
    """"prefill 78.7%, decode 60.6%" (tokens found / looked up, per actor); n/a without counters."""
    if not prefix_cache:
        return "n/a"
    return ", ".join(f"{actor} {_share(rates['hit_rate'])}" for actor, rates in prefix_cache["actors"].items())


def _cached(summary: dict) -> str:
    return f"{summary.get('cached_prompt_tokens', 0)} ({_share(summary.get('cached_prompt_token_share'))})"
