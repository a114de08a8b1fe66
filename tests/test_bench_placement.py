"""pdserve.bench.compare's view of adaptive placement: the /metrics parser on pages the server's own exporter
renders, the sampler against a live aiohttp server, the timeline summary and plot, and the issue-13
targets (which load each is stated for, the better of the two fixed modes as reference)."""
from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.bench import compare_report, loadtest
from pdserve.bench.compare_report import ADAPTIVE, COLOC, DISAGG, evaluate_targets
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.plot import plot_roles
from pdserve.bench.server_metrics import PlacementSampler, parse_placement, timeline_summary
from pdserve.bench.servers import ServerOutcome, ServerSpec
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.workloads import TrafficSpec, WorkloadSpec
from pdserve.engine.core.messages import ActorStats, EngineStats
from pdserve.server.metrics import Metrics


def _page(prefill_role: str, decode_role: str, lent: tuple[int, int], local: int, remote: int) -> str:
    actors = (ActorStats("prefill", 0, 1, 2, 10, 3, 0.0, role=prefill_role, lent_steps=lent[0]),
              ActorStats("decode", 2, 0, 5, 10, 9, 0.0, role=decode_role, lent_steps=lent[1],
                         local_prefills=local, remote_prefills=remote))
    return Metrics(lambda: EngineStats(actors, running=2, waiting=1), lambda: []).render().decode()


def test_placement_is_read_off_the_servers_own_page():
    rng = random.Random(13)
    lent, local, remote = (rng.randrange(100), rng.randrange(100)), rng.randrange(50), rng.randrange(50)
    placement = parse_placement(_page("lent", "decode", lent, local, remote))
    assert placement == {"roles": {"prefill": "lent", "decode": "decode"},
                         "prefills": {"local": local, "remote": remote},
                         "lent_steps": {"prefill": lent[0], "decode": lent[1]}}
    fixed = Metrics(lambda: EngineStats((ActorStats("colocated", 1, 0, 1, 8, 2, 0.0, role="colocated"),), 1, 0),
                    lambda: []).render().decode()
    assert parse_placement(fixed)["roles"] == {"colocated": "colocated"}


@pytest.mark.parametrize("text", ["", "not a metrics page {{{", "# TYPE other gauge\nother 1.0\n",
                                  Metrics(lambda: None, lambda: []).render().decode()])
def test_a_page_without_roles_has_no_placement(text):
    assert parse_placement(text) is None


class PageServer:
    """Serves `pages` at /metrics in turn (the last one again and again); `served` is set after `wanted` reads."""

    def __init__(self, pages: list[str], wanted: int, status: int = 200) -> None:
        self.pages, self.wanted, self.status = pages, wanted, status
        self.reads, self.served = 0, asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/metrics", self.metrics)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.pages[min(self.reads, len(self.pages) - 1)]
        self.reads += 1
        if self.reads >= self.wanted:
            self.served.set()
        return web.Response(text=text, status=self.status)


async def _sample(pages: list[str], wanted: int, status: int = 200) -> tuple[PlacementSampler, PageServer]:
    pages_server = PageServer(pages, wanted, status)
    server = TestServer(pages_server.app, host="127.0.0.1")
    await server.start_server()
    try:
        endpoint = EndpointConfig(base_url=str(server.make_url("")).rstrip("/"), model="m")
        async with PlacementSampler(endpoint, interval=0.0) as sampler:
            await asyncio.wait_for(pages_server.served.wait(), 30)
    finally:
        await server.close()
    return sampler, pages_server


async def test_the_sampler_records_each_page_in_order():
    pages = [_page("idle", "idle", (0, 0), 0, 0), _page("prefill", "decode", (0, 0), 1, 1),
             _page("lent", "decode", (0, 3), 2, 1)]
    sampler, server = await _sample(pages, wanted=5)
    assert len(sampler.samples) >= 5
    roles = [placement["roles"]["prefill"] for _, placement in sampler.samples]
    assert roles[:3] == ["idle", "prefill", "lent"] and set(roles[3:]) == {"lent"}
    times = [at for at, _ in sampler.samples]
    assert times == sorted(times)
    timeline = sampler.timeline(origin=times[1])
    assert timeline[1]["t"] == 0.0 and timeline[0]["t"] < 0 and timeline[2]["prefills"] == {"local": 2, "remote": 1}


async def test_a_server_without_metrics_gives_an_empty_timeline():
    sampler, server = await _sample(["404: Not Found"], wanted=1, status=404)
    assert sampler.timeline(0.0) == [] and server.reads >= 1


def _timeline() -> list[dict]:
    rows = [("idle", "idle", 5, 0, 1, 0), ("prefill", "decode", 5, 2, 2, 1), ("lent", "decode", 9, 2, 2, 1),
            ("lent", "decode", 14, 3, 3, 1)]
    return [{"t": 0.25 * i, "roles": {"prefill": p, "decode": d}, "prefills": {"local": loc, "remote": rem},
             "lent_steps": {"prefill": lp, "decode": ld}} for i, (p, d, ld, lp, loc, rem) in enumerate(rows)]


def test_timeline_summary_counts_the_run_and_shares_the_roles():
    summary = timeline_summary(_timeline())
    assert summary["samples"] == 4
    assert summary["prefills"] == {"local": 2, "remote": 1} and summary["lent_steps"] == {"prefill": 3, "decode": 9}
    assert summary["role_shares"]["prefill"] == pytest.approx({"idle": 0.25, "prefill": 0.25, "lent": 0.5})
    assert summary["role_shares"]["decode"] == pytest.approx({"idle": 0.25, "decode": 0.75})
    assert timeline_summary([]) is None


def test_plot_roles_draws_each_run_with_a_timeline(tmp_path):
    long_arrival = RequestRecord(0, "long", 100, 4, 0.3, success=True)
    fixed = [{"t": 0.25 * i, "roles": {"colocated": "colocated"}, "prefills": {"local": 0, "remote": 0},
              "lent_steps": {"colocated": 0}} for i in range(3)]
    plot_roles([("adaptive", _timeline(), [long_arrival]), ("colocated", fixed, []), ("hf", [], [])],
               tmp_path / "roles.png")
    assert (tmp_path / "roles.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        plot_roles([("hf", [], [])], tmp_path / "none.png")


def _outcome(name: str, **summary) -> ServerOutcome:
    return ServerOutcome(ServerSpec(name, name.replace("-", " "), ()), "cmd", summary=summary)


def _options(workload: WorkloadSpec, rate: float) -> loadtest.Options:
    return loadtest.Options(workload, TrafficSpec(request_rate=rate), {}, (99.0,), ())


def _adaptive(verdicts: list[tuple[str, str]]) -> dict[str, str]:
    return {what: verdict for what, verdict in verdicts if what.startswith("adaptive")}


def test_issue_13_targets_are_evaluated_on_their_own_load():
    saturated = _options(WorkloadSpec(name="random"), float("inf"))
    runs = [_outcome(ADAPTIVE, output_throughput=96.0), _outcome(COLOC, output_throughput=100.0),
            _outcome(DISAGG, output_throughput=70.0)]
    verdicts = _adaptive(evaluate_targets(runs, saturated))
    assert verdicts == {"adaptive output tok/s >= 0.95 x colocated": "96.00 vs 100.00 (0.96x): met"}
    heavy = _options(WorkloadSpec(name="mixed", long_fraction=0.3), 1.0)
    runs = [_outcome(ADAPTIVE, p99_short_itl_ms=60.0), _outcome(COLOC, p99_short_itl_ms=100.0)]
    assert _adaptive(evaluate_targets(runs, heavy)) == {
        "adaptive short-stream p99 ITL <= 1/2 x colocated": "60.00 vs 100.00 (0.60x): NOT met"}


def test_the_mixed_target_takes_the_better_fixed_mode_per_figure():
    light = _options(WorkloadSpec(name="mixed", long_fraction=0.1), 2.0)
    figures = {ADAPTIVE: (150.0, 900.0, 40.0, 100.0), DISAGG: (160.0, 800.0, 50.0, 120.0),
               COLOC: (120.0, 1000.0, 30.0, 95.0)}
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    runs = [_outcome(name, **dict(zip(keys, values))) for name, values in figures.items()]
    verdicts = _adaptive(evaluate_targets(runs, light))
    better = "the better fixed mode"
    assert verdicts == {
        f"adaptive median TTFT <= 1.1 x {better}": "150.00 vs 120.00 (pdserve colocated) (1.25x): NOT met",
        f"adaptive p99 TTFT <= 1.1 x {better}": "900.00 vs 800.00 (pdserve disaggregated) (1.12x): NOT met",
        f"adaptive median ITL <= 1.1 x {better}": "40.00 vs 30.00 (pdserve colocated) (1.33x): NOT met",
        f"adaptive p99 ITL <= 1.1 x {better}": "100.00 vs 95.00 (pdserve colocated) (1.05x): met"}
    assert _adaptive(evaluate_targets([runs[0], runs[2]], light)) == {}
    failed = [runs[0], runs[1], ServerOutcome(runs[2].spec, "cmd", error="boom")]
    assert set(_adaptive(evaluate_targets(failed, light)).values()) == {"n/a (pdserve colocated failed)"}
    assert all(t.load in compare_report.LOADS for t in compare_report.TARGETS if t.load)
