"""A server's own counters, read from GET /metrics: pdserve's prefix-cache queries and hits (tokens,
per actor) before and after a run, and its adaptive placement (each actor's role, local and remote
prefills, lent steps) sampled all through one. A server without them (or without /metrics) gives None."""
from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.sse_client import EndpointConfig

QUERIES = "pdserve_prefix_cache_queries_total"
HITS = "pdserve_prefix_cache_hits_total"
SPEC_DRAFTS = "pdserve_spec_decode_num_drafts_total"             # vLLM's spec-decode counters, pdserve-named
SPEC_DRAFT_TOKENS = "pdserve_spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "pdserve_spec_decode_num_accepted_tokens_total"
SPEC_NAMES = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)

Counters = dict[tuple[str, str], float]          # (sample name, actor label) -> value


ROLE = "pdserve_actor_role"
PREFILLS = "pdserve_prefills_total"
LENT_STEPS = "pdserve_lent_steps_total"


async def fetch_metrics(session: aiohttp.ClientSession, endpoint: EndpointConfig) -> str | None:
    """The server's GET /metrics page; None when it cannot be read."""
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        async with session.get(f"{endpoint.root}/metrics", headers=endpoint.headers, timeout=timeout) as response:
            if response.status != 200:
                return None
            return await response.text(errors="replace")
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


async def scrape_prefix_cache(session: aiohttp.ClientSession, endpoint: EndpointConfig) -> Counters | None:
    """The prefix-cache counters now; None when /metrics cannot be read or holds none of them."""
    text = await fetch_metrics(session, endpoint)
    return None if text is None else parse_prefix_cache(text)


def _samples(text: str) -> list | None:
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError):
        return None


def parse_prefix_cache(text: str) -> Counters | None:
    """The QUERIES and HITS samples (and the SPEC_NAMES ones, actor "") of a Prometheus text page; None when
    there are none or it is not one."""
    names = (QUERIES, HITS, *SPEC_NAMES)
    counters = {(s.name, s.labels.get("actor", "")): s.value for s in _samples(text) or () if s.name in names}
    return counters or None


def parse_placement(text: str) -> dict | None:
    """{"roles": {actor: role}, "prefills": {placement: count}, "lent_steps": {actor: count}} of a Prometheus
    text page (a role is the label its ROLE gauge is 1 for); None when the page has no ROLE gauge or is not one."""
    samples = _samples(text) or ()
    roles = {s.labels["actor"]: s.labels["role"] for s in samples if s.name == ROLE and s.value == 1.0}
    if not roles:
        return None
    return {"roles": roles,
            "prefills": {s.labels["placement"]: s.value for s in samples if s.name == PREFILLS},
            "lent_steps": {s.labels["actor"]: s.value for s in samples if s.name == LENT_STEPS}}


class PlacementSampler:
    """`async with PlacementSampler(endpoint):` reads the server's placement (`parse_placement`) every
    `interval` s until the block ends; a server whose first page has none is not asked again."""

    def __init__(self, endpoint: EndpointConfig, interval: float = 0.25) -> None:
        self.endpoint, self.interval = endpoint, interval
        self.samples: list[tuple[float, dict]] = []      # (time.perf_counter(), parse_placement)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> PlacementSampler:
        self._task = asyncio.create_task(self._sample_all())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _sample_all(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                started = time.perf_counter()
                text = await fetch_metrics(session, self.endpoint)
                placement = None if text is None else parse_placement(text)
                if placement is None and not self.samples:
                    return
                if placement is not None:
                    self.samples.append((started, placement))
                await asyncio.sleep(max(0.0, started + self.interval - time.perf_counter()))

    def timeline(self, origin: float) -> list[dict]:
        """The samples, each {"t": seconds since `origin` (a time.perf_counter()), **placement}."""
        return [{"t": round(at - origin, 4), **placement} for at, placement in self.samples]


def prefix_cache_delta(before: Counters | None, after: Counters | None) -> dict | None:
    """Queries, hits and hit rate (hits / queries, None without queries) of the run, in total and per actor;
    None when either scrape found no counters."""
    if before is None or after is None:
        return None
    actors = sorted({actor for name, actor in after if name in (QUERIES, HITS)})
    per_actor = {actor: _rate(*(after.get((name, actor), 0.0) - before.get((name, actor), 0.0)
                                for name in (QUERIES, HITS))) for actor in actors}
    total = _rate(sum(a["queries"] for a in per_actor.values()), sum(a["hits"] for a in per_actor.values()))
    return total | {"actors": per_actor}


def _rate(queries: float, hits: float) -> dict:
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None}


def timeline_summary(timeline: list[dict]) -> dict | None:
    """Over a timeline (PlacementSampler.timeline): prefills and lent steps counted between its first and last
    sample, and the share of samples each actor spent in each role; None when it has no samples."""
    if not timeline:
        return None
    first, last = timeline[0], timeline[-1]
    shares: dict[str, dict[str, float]] = {}
    for sample in timeline:
        for actor, role in sample["roles"].items():
            counts = shares.setdefault(actor, {})
            counts[role] = counts.get(role, 0.0) + 1.0 / len(timeline)
    return {"samples": len(timeline), "role_shares": shares,
            "prefills": _delta(first["prefills"], last["prefills"]),
            "lent_steps": _delta(first["lent_steps"], last["lent_steps"])}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def spec_decode_delta(before: Counters | None, after: Counters | None) -> dict | None:
    """Drafts, draft tokens and accepted tokens over the run, the acceptance rate (accepted / draft tokens)
    and the mean tokens a verification emits (1 + accepted / drafts); None when the server exports none."""
    if before is None or after is None or (SPEC_DRAFTS, "") not in after:
        return None
    drafts, tokens, accepted = (after.get((name, ""), 0.0) - before.get((name, ""), 0.0) for name in SPEC_NAMES)
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens > 0 else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts > 0 else None}
