"""Load-test plots: TTFT and ITL CDFs, inter-token latency over time with long-prompt
arrivals marked, and pdserve's actor roles over time (matplotlib, Agg canvas; no display needed)."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from pdserve.bench.metrics import RequestRecord

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _cdf(ax: Axes, values_ms: Sequence[float], label: str, color: str, linestyle: str = "-") -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    ax.step(ordered, fractions, where="post", label=label, color=color, linestyle=linestyle)


def token_times(record: RequestRecord) -> list[tuple[float, float]]:
    """(emission time in s since the start, gap before it in ms) of each token after the first."""
    first = record.send_time + record.ttft
    times = accumulate(record.itl, initial=first)
    next(times)
    return [(time, gap * 1000.0) for time, gap in zip(times, record.itl)]


def _strip(ax: Axes, label: str, records: Sequence[RequestRecord], color: str) -> None:
    points = [p for r in records if r.success and r.kind == "short" for p in token_times(r)]
    if points:
        xs, ys = zip(*points)
        ax.scatter(xs, ys, s=3, color=color, alpha=0.6, linewidths=0)
        if max(ys) > 0:             # log: a 50 ms rhythm and a 20 s stall both stay readable
            ax.set_yscale("log")
    for record in records:
        if record.kind == "long":
            ax.axvline(record.send_time, color="black", linewidth=0.8, alpha=0.5, linestyle=":")
    ax.set_ylabel("ITL (ms)")
    ax.set_title(f"{label}: short-stream ITL over time (dotted: long-prompt arrivals)", fontsize=9, loc="left")


def plot_runs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: str | Path) -> None:
    """Draw every run's TTFT and ITL CDFs on shared axes and one ITL-over-time strip each; save a PNG.

    Raises ValueError when `runs` is empty.
    """
    if not runs:
        raise ValueError("nothing to plot")
    fig = Figure(figsize=(12, 4 + 2.2 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + len(runs), 2, height_ratios=[3.0] + [1.8] * len(runs))
    ax_ttft, ax_itl = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    for color, (label, records) in zip(COLORS * len(runs), runs):
        ok = [r for r in records if r.success]
        _cdf(ax_ttft, [r.ttft * 1000.0 for r in ok], label, color)
        _cdf(ax_itl, [g * 1000.0 for r in ok for g in r.itl], f"{label} (all)", color)
        _cdf(ax_itl, [g * 1000.0 for r in ok if r.kind == "short" for g in r.itl], f"{label} (short)", color, "--")
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "inter-token latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.set_xscale("symlog", linthresh=1.0)  # ITL can be 0 when chunks arrive merged
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.legend(fontsize=8)
    strip_axes = []
    for row, (color, (label, records)) in enumerate(zip(COLORS * len(runs), runs)):
        first = strip_axes[0] if strip_axes else None
        ax = fig.add_subplot(grid[1 + row, :], sharex=first, sharey=first)
        _strip(ax, label, records, color)
        strip_axes.append(ax)
    strip_axes[-1].set_xlabel("time since start (s)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


ROLE_COLORS = {"decode": "tab:blue", "prefill": "tab:orange", "lent": "tab:green", "idle": "lightgray",
               "colocated": "tab:purple"}


def _role_bands(ax: Axes, timeline: Sequence[dict]) -> list[str]:
    """One row of coloured spans per actor, a span per sample (to the next one); returns the actor names."""
    actors = sorted({actor for sample in timeline for actor in sample["roles"]})
    ends = [sample["t"] for sample in timeline[1:]] + [timeline[-1]["t"]]
    for row, actor in enumerate(actors):
        for sample, end in zip(timeline, ends):
            role = sample["roles"].get(actor)
            if role is not None and end > sample["t"]:
                ax.broken_barh([(sample["t"], end - sample["t"])], (row - 0.4, 0.8),
                               color=ROLE_COLORS.get(role, "tab:red"), linewidth=0)
    ax.set_yticks(range(len(actors)), actors)
    return actors


def _role_counters(ax: Axes, timeline: Sequence[dict]) -> None:
    times = [sample["t"] for sample in timeline]
    series = {f"{name} prefills": [s["prefills"].get(name, 0.0) for s in timeline] for name in ("local", "remote")}
    series["lent steps"] = [sum(s["lent_steps"].values()) for s in timeline]
    for (label, values), color in zip(series.items(), ("black", "tab:red", "tab:green")):
        if any(values):
            ax.plot(times, [v - values[0] for v in values], label=label, color=color, linewidth=1.0)
    ax.set_ylabel("count since start", fontsize=8)
    if ax.has_data():
        ax.legend(fontsize=7, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no placement counted (a fixed mode)", transform=ax.transAxes, ha="center", fontsize=8)


def plot_roles(runs: Sequence[tuple[str, Sequence[dict], Sequence[RequestRecord]]], path: str | Path) -> None:
    """For each (title, role timeline, records): each actor's role over time (coloured spans, long-prompt
    arrivals dotted) above its placement counters; save a PNG. Raises ValueError when no run has a sample."""
    runs = [run for run in runs if run[1]]
    if not runs:
        raise ValueError("no role timeline to plot")
    fig = Figure(figsize=(12, 3.2 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2 * len(runs), 1, height_ratios=[1.0, 1.2] * len(runs))
    for index, (title, timeline, records) in enumerate(runs):
        bands, counters = fig.add_subplot(grid[2 * index]), fig.add_subplot(grid[2 * index + 1])
        _role_bands(bands, timeline)
        _role_counters(counters, timeline)
        for record in records:
            if record.kind == "long":
                bands.axvline(record.send_time, color="black", linewidth=0.8, alpha=0.6, linestyle=":")
        roles = sorted({role for sample in timeline for role in sample["roles"].values()})
        legend = ", ".join(f"{role} = {ROLE_COLORS.get(role, 'tab:red').removeprefix('tab:')}" for role in roles)
        bands.set_title(f"{title}: actor roles over time ({legend}; dotted: long-prompt arrivals)", fontsize=9,
                        loc="left")
        counters.sharex(bands)
        counters.set_xlabel("time since the measured run started (s; before 0: warm-up)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
