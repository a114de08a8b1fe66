"""pdserve.bench.compare's report: targets and verdicts, and the Markdown file `--report` names."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import loadtest
from pdserve.bench.documents import machine_description
from pdserve.bench.metrics import markdown_comparison
from pdserve.bench.server_metrics import timeline_summary
from pdserve.bench.servers import KV_TIERS_AB, OPTIONAL_SERVERS, PREFIX_CACHING_AB, REPO, SERVER_NAMES, ServerOutcome
from pdserve.bench.turn_metrics import markdown_turns


ADAPTIVE, DISAGG, COLOC, HF = SERVER_NAMES
(LLAMA_CPP,) = OPTIONAL_SERVERS
AB_ON, AB_OFF = (name for name, _ in PREFIX_CACHING_AB)
TIERS_ON, TIERS_OFF = (name for name, _ in KV_TIERS_AB)


@dataclass(frozen=True, slots=True)
class Target:
    """`server`'s summary[`key`] against `factor` x the best of `references`' ("le": at most, "ge": at least),
    on every run, or only on runs of the named `load` (a key of LOADS)."""

    what: str
    server: str
    references: tuple[str, ...]
    key: str
    factor: float
    relation: str
    load: str = ""


LOADS = {  # the loads issue 13 states its targets on: (workload, traffic) -> whether a run is one
    "saturated": lambda w, t: w.name == "random" and math.isinf(t.request_rate),
    "30% long, 1 req/s": lambda w, t: w.name == "mixed" and w.long_fraction == 0.3 and t.request_rate == 1.0,
    "10% long, 2 req/s": lambda w, t: w.name == "mixed" and w.long_fraction == 0.1 and t.request_rate == 2.0,
}
FIXED = (DISAGG, COLOC)
TARGETS = (
    Target("short-stream p99 ITL <= 1/2 x colocated", DISAGG, (COLOC,), "p99_short_itl_ms", 0.5, "le"),
    Target("output tok/s >= 2 x transformers serve", DISAGG, (HF,), "output_throughput", 2.0, "ge"),
    Target("p99 TTFT <= 1/4 x transformers serve", DISAGG, (HF,), "p99_ttft_ms", 0.25, "le"),
    Target("p99 ITL <= 1/4 x transformers serve", DISAGG, (HF,), "p99_itl_ms", 0.25, "le"),
    Target("adaptive output tok/s >= 0.95 x colocated", ADAPTIVE, (COLOC,), "output_throughput", 0.95, "ge",
           "saturated"),
    Target("adaptive short-stream p99 ITL <= 1/2 x colocated", ADAPTIVE, (COLOC,), "p99_short_itl_ms", 0.5, "le",
           "30% long, 1 req/s"),
    *(Target(f"adaptive {label} <= 1.1 x the better fixed mode", ADAPTIVE, FIXED, key, 1.1, "le", "10% long, 2 req/s")
      for label, key in (("median TTFT", "median_ttft_ms"), ("p99 TTFT", "p99_ttft_ms"),
                         ("median ITL", "median_itl_ms"), ("p99 ITL", "p99_itl_ms"))),
    *(Target(f"pdserve {mode} {label} <= llama.cpp's", server, (LLAMA_CPP,), key, 1.0, "le")
      for mode, server in (("adaptive", ADAPTIVE), ("colocated", COLOC))
      for label, key in (("median ITL", "median_itl_ms"), ("p99 ITL", "p99_itl_ms"))),
    Target("turn >= 2 median TTFT with KV tiers <= 0.3 x without", TIERS_ON, (TIERS_OFF,),
           "median_ttft_later_turns_ms", 0.3, "le"),
    Target("output tok/s with KV tiers >= 0.97 x without", TIERS_ON, (TIERS_OFF,), "output_throughput", 0.97, "ge"),
    Target("turn >= 2 median TTFT with prefix caching <= 0.3 x without", AB_ON, (AB_OFF,),
           "median_ttft_later_turns_ms", 0.3, "le"),
)


def evaluate_targets(outcomes: list[ServerOutcome], options: loadtest.Options) -> list[tuple[str, str]]:
    """(target, verdict with the numbers) for each target of this run's load whose servers were all in it."""
    by_name = {outcome.spec.name: outcome for outcome in outcomes}
    return [(target.what, _verdict(target, by_name))
            for target in TARGETS if _applies(target, options) and {target.server, *target.references} <= set(by_name)]


def _applies(target: Target, options: loadtest.Options) -> bool:
    return not target.load or LOADS[target.load](options.workload, options.traffic)


def _verdict(target: Target, by_name: dict[str, ServerOutcome]) -> str:
    outcome, references = by_name[target.server], [by_name[name] for name in target.references]
    failed = [o.spec.title for o in (outcome, *references) if not o.ok]
    if failed:
        return f"n/a ({' and '.join(failed)} failed)"
    key = target.key
    values = [o.summary.get(key) for o in (outcome, *references)]
    if any(value is None for value in values):
        return f"n/a ({key} not measured)"
    value, bases = values[0], values[1:]
    base = min(bases) if target.relation == "le" else max(bases)
    met = value <= target.factor * base if target.relation == "le" else value >= target.factor * base
    ratio = f"{value / base:.2f}x" if base else "inf"
    against = f" ({references[bases.index(base)].spec.title})" if len(references) > 1 else ""
    return f"{value:.2f} vs {base:.2f}{against} ({ratio}): {'met' if met else 'NOT met'}"


def roles_plot_path(plot: str) -> str:
    """Where the role timeline plot of a run whose main plot is `plot` goes."""
    path = Path(plot)
    return str(path.with_name(f"{path.stem}_roles.png"))


def _shown_path(path: str) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def _workload_line(args: argparse.Namespace, options: loadtest.Options) -> str:
    w, t = options.workload, options.traffic
    unit = "words" if w.tokens_per_word == 1.0 else f"tokens (at {w.tokens_per_word:.2f} tokens/word)"
    shape = {
        "mixed": f"short {w.short_input_len} / long {w.long_input_len} prompt {unit}, {w.long_fraction:.0%} long, "
                 f"{w.output_len} output tokens",
        "random": f"input {w.random_input_len} {unit}, output {w.random_output_len} tokens, "
                  f"range ratio {w.random_range_ratio:g}",
        "sharegpt": f"ShareGPT file {w.dataset_path}",
        "multiturn": f"{w.num_turns} turns each, shared system prompt {w.system_prompt_len} {unit}, user messages "
                     f"{w.user_message_len} {unit}" + (f" (the first with a document of {w.document_len} {unit})"
                                                        if w.document_len else "") +
                     f", {w.output_len} output tokens, think time {w.think_time:g} s",
    }[w.name]
    multiturn = w.name == "multiturn"
    api = "chat/completions" if args.endpoint == "chat" or multiturn else "completions"
    count = f"{w.num_conversations} conversations" if multiturn else f"{t.num_prompts} requests"
    return (f"{w.name} ({shape}); {count} at {t.request_rate:g} {'conv' if multiturn else 'req'}/s (burstiness "
            f"{t.burstiness:g}), max concurrency {t.max_concurrency or 'none'}, seed {t.seed}, {t.num_warmups} "
            f"warm-ups; /v1/{api}, temperature {args.temperature:g}; goodput SLO {_slo_text(options.slo)}")


def _slo_text(slo: dict[str, float]) -> str:
    return " ".join(f"{name}_ms={bound:g}" for name, bound in slo.items()) or "none (no --slo)"


def render_report(args: argparse.Namespace, options: loadtest.Options, model_dir: str,
                  outcomes: list[ServerOutcome], command: str, date: str) -> str:
    """The Markdown report of one bench.compare run: what ran where, the table, the targets, the servers."""
    titles = " vs ".join(o.spec.title for o in outcomes)
    lines = [
        f"# Serving comparison ({args.section}): {titles}", "",
        f"- Command: `{command}`", f"- Date: {date}", f"- Machine: {machine_description()}",
        f"- Model: `{model_dir}`", f"- Workload: {_workload_line(args, options)}", "",
        markdown_comparison([(o.spec.title, o.summary, o.startup_s) for o in outcomes]), "",
        markdown_turns([(o.spec.title, o.summary) for o in outcomes]), "",
        "Targets (each server against its reference):", "",
    ]
    lines += [f"- {what}: {verdict}" for what, verdict in evaluate_targets(outcomes, options)] or ["- none evaluated"]
    placements = [_placement_line(o.spec.title, o.timeline) for o in outcomes if o.timeline]
    if placements:
        lines += ["", "Placement (each pdserve server's /metrics, sampled through the run):", "", *placements]
    lines += ["", "Servers:", ""]
    lines += [f"- {o.spec.title}: `{o.command}`" + ("" if o.ok else f" -- failed: {o.error}") for o in outcomes]
    roles = f"; actor roles over time: `{_shown_path(roles_plot_path(args.plot))}`" \
        if any(o.timeline for o in outcomes) else ""
    lines += ["", f"Plot: `{_shown_path(args.plot)}`{roles}; per-request data: `{_shown_path(args.result_json)}`.",
              "Prompt lengths are sized from a word list; the server-reported prompt tokens are in the table. "
              "pdserve gets max_tokens = min_tokens with ignore_eos."]
    if any(o.spec.name == HF for o in outcomes):
        lines.append("transformers serve never sends `data: [DONE]`: its streams count as complete on a "
                     "finish_reason and a clean end of stream; its output lengths are pinned by a per-request "
                     "`generation_config` (no EOS, min_new_tokens = max_new_tokens).")
    return "\n".join(lines)


def _placement_line(title: str, timeline: tuple[dict, ...]) -> str:
    summary = timeline_summary(list(timeline))
    prefills = summary["prefills"]
    lent = ", ".join(f"{actor} {count:g}" for actor, count in sorted(summary["lent_steps"].items())) or "none"
    roles = "; ".join(f"{actor}: " + ", ".join(f"{role} {share:.0%}" for role, share in sorted(
        shares.items(), key=lambda item: -item[1])) for actor, shares in sorted(summary["role_shares"].items()))
    return (f"- {title}: {prefills.get('local', 0):g} local / {prefills.get('remote', 0):g} remote prefills, "
            f"lent steps {lent}; share of {summary['samples']} samples in each role: {roles}")


def write_report(path: Path, report: str) -> None:
    """Write `report` to `path` (its folder made if missing), replacing what was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.rstrip("\n") + "\n", encoding="utf-8")
