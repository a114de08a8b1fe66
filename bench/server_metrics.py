"""A server's own counters, read from GET /metrics before and after a run: pdserve's prefix-cache
queries and hits (tokens, per actor). A server without them (or without /metrics) gives None."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.sse_client import EndpointConfig

QUERIES = "pdserve_prefix_cache_queries_total"
HITS = "pdserve_prefix_cache_hits_total"

Counters = dict[tuple[str, str], float]          # (sample name, actor label) -> value


async def scrape_prefix_cache(session: aiohttp.ClientSession, endpoint: EndpointConfig) -> Counters | None:
    """The prefix-cache counters now; None when /metrics cannot be read or holds none of them."""
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        async with session.get(f"{endpoint.root}/metrics", headers=endpoint.headers, timeout=timeout) as response:
            if response.status != 200:
                return None
            text = await response.text(errors="replace")
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    return parse_prefix_cache(text)


def parse_prefix_cache(text: str) -> Counters | None:
    """The QUERIES and HITS samples of a Prometheus text page; None when there are none or it is not one."""
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError):
        return None
    counters = {(s.name, s.labels.get("actor", "")): s.value for s in samples if s.name in (QUERIES, HITS)}
    return counters or None


def prefix_cache_delta(before: Counters | None, after: Counters | None) -> dict | None:
    """Queries, hits and hit rate (hits / queries, None without queries) of the run, in total and per actor;
    None when either scrape found no counters."""
    if before is None or after is None:
        return None
    actors = sorted({actor for _, actor in after})
    per_actor = {actor: _rate(*(after.get((name, actor), 0.0) - before.get((name, actor), 0.0)
                                for name in (QUERIES, HITS))) for actor in actors}
    total = _rate(sum(a["queries"] for a in per_actor.values()), sum(a["hits"] for a in per_actor.values()))
    return total | {"actors": per_actor}


def _rate(queries: float, hits: float) -> dict:
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None}
