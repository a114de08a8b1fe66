"""Prometheus metrics on a private CollectorRegistry; engine gauges are read at scrape time."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.engine.coordinator.slo import Slos
from pdserve.engine.core.messages import EngineStats, FinishReason
from pdserve.server.metrics_vllm import VllmMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
COMPILE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
TRANSFER_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


TIER_SERIES = (
    (CounterMetricFamily, "hits", "Prompt tokens loaded from the KV tier instead of computed", "hit_tokens"),
    (CounterMetricFamily, "bytes_in", "KV bytes written to the tier", "bytes_in"),
    (CounterMetricFamily, "bytes_out", "KV bytes read from the tier into a pool", "bytes_out"),
    (CounterMetricFamily, "evictions", "Blocks the tier dropped, least recently used first, to make room", "evictions"),
    (CounterMetricFamily, "bad_blocks", "Tier records that failed their check (dropped and recomputed, never used)",
     "bad_blocks"),
    (GaugeMetricFamily, "blocks", "KV blocks the tier holds", "blocks"),
    (GaugeMetricFamily, "capacity_blocks", "KV blocks the tier can hold", "capacity_blocks"),
)


class EngineCollector(Collector):
    """Gauges from `pdserve.engine.stats()`, one sample set per scrape; nothing while no engine runs."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        yield GaugeMetricFamily("pdserve_requests_running", "Sequences being generated", value=stats.running)
        yield GaugeMetricFamily("pdserve_requests_waiting", "Requests waiting for their first token",
                                value=stats.waiting)
        yield GaugeMetricFamily("pdserve_requests_unfinished", "Requests whose stream has not ended",
                                value=stats.num_unfinished)
        yield CounterMetricFamily("pdserve_engine_restarts", "Times the actors were rebuilt after a failure",
                                  value=stats.restarts)
        yield GaugeMetricFamily("pdserve_engine_dead", "1 once the engine has failed for good (the server exits)",
                                value=float(stats.dead))
        yield from self._per_actor(stats)
        if stats.tiers:
            yield from self._tiers(stats)

    @staticmethod
    def _per_actor(stats: EngineStats) -> Iterator[GaugeMetricFamily]:
        labels = ["actor", "unit"]
        families = {
            "kv_blocks_used": GaugeMetricFamily("pdserve_kv_blocks_used", "KV cache blocks in use", labels=labels),
            "kv_blocks_total": GaugeMetricFamily("pdserve_kv_blocks_total", "KV cache blocks in the pool",
                                                 labels=labels),
            "steps": GaugeMetricFamily("pdserve_actor_steps", "Steps the actor has run", labels=labels),
            "alive": GaugeMetricFamily("pdserve_actor_alive", "1 while the actor's loop runs", labels=labels),
            "retired": GaugeMetricFamily("pdserve_unit_retired", "1 once the unit failed and could not be "
                                         "restarted: it serves no more until the server restarts", labels=labels),
        }
        counters = {
            "prefix_cache_queries": CounterMetricFamily("pdserve_prefix_cache_queries", "Prompt tokens looked up "
                                                        "in the prefix cache", labels=labels),
            "prefix_cache_hits": CounterMetricFamily("pdserve_prefix_cache_hits", "Prompt tokens found in the "
                                                     "prefix cache", labels=labels),
        }
        counters["lent_steps"] = CounterMetricFamily("pdserve_lent_steps", "Steps an actor ran with cores "
                                                     "borrowed from the other actor", labels=labels)
        counters["kv_verify_mismatches"] = CounterMetricFamily(
            "pdserve_kv_verify_mismatches", "Prefill-to-decode KV copies --kv-verify found different at the two ends "
            "(made again; a request whose copy differed twice failed)", labels=labels)
        for actor in stats.actors:
            for name, family in {**families, **counters}.items():
                family.add_metric([actor.name, actor.unit or actor.name], float(getattr(actor, name)))
        yield from families.values()
        yield from counters.values()
        yield from EngineCollector._placement(stats)
        if any(a.spec_accepted_per_position for a in stats.actors):
            yield from EngineCollector._speculative(stats)
        yield from EngineCollector._routing(stats)

    @staticmethod
    def _placement(stats: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        prefills = CounterMetricFamily("pdserve_prefills", "Prompts placed by adaptive mode", labels=["placement"])
        prefills.add_metric(["local"], float(sum(a.local_prefills for a in stats.actors)))
        prefills.add_metric(["remote"], float(sum(a.remote_prefills for a in stats.actors)))
        roles = GaugeMetricFamily("pdserve_actor_role", "1 for what each actor's compute does now",
                                  labels=["actor", "unit", "role"])
        for actor in stats.actors:
            roles.add_metric([actor.name, actor.unit or actor.name, actor.role], 1.0)
        yield prefills
        yield roles

    @staticmethod
    def _routing(stats: EngineStats) -> Iterator[CounterMetricFamily]:
        """What the coordinator sent to each unit: prompts (phase prefill), prefilled sequences (decode)."""
        routed = CounterMetricFamily("pdserve_routed", "Requests the coordinator routed to each unit, by phase",
                                     labels=["unit", "phase"])
        for actor in stats.actors:
            unit = actor.unit or actor.name
            routed.add_metric([unit, "prefill"], float(actor.routed_prefill))
            routed.add_metric([unit, "decode"], float(actor.routed_decode))
        yield routed


    @staticmethod
    def _tiers(stats: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Per KV tier (host, disk): what it holds and what went through it."""
        for kind, name, text, field in TIER_SERIES:
            family = kind(f"pdserve_kv_tier_{name}", text, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.name], float(getattr(tier, field)))
            yield family

    @staticmethod
    def _speculative(stats: EngineStats) -> Iterator[CounterMetricFamily]:
        """vLLM's spec-decode counters: verifications, draft tokens, accepted tokens, accepted per position."""
        actors = stats.actors
        for name, text, count in (("num_drafts", "Verifications of drafts run", lambda a: a.spec_drafts),
                                  ("num_draft_tokens", "Draft tokens verified", lambda a: a.spec_draft_tokens),
                                  ("num_accepted_tokens", "Draft tokens accepted", lambda a: a.spec_accepted_tokens)):
            family = CounterMetricFamily(f"pdserve_spec_decode_{name}", text)
            family.add_metric([], float(sum(count(a) for a in actors)))
            yield family
        per_position = CounterMetricFamily("pdserve_spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each draft position", labels=["position"])
        width = max(len(a.spec_accepted_per_position) for a in actors)
        for position in range(width):
            accepted = sum(a.spec_accepted_per_position[position] for a in actors
                           if position < len(a.spec_accepted_per_position))
            per_position.add_metric([str(position)], float(accepted))
        yield per_position


class Metrics:
    """Every metric the server exports; `render()` produces the Prometheus text."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 transfer_times: Callable[[], list[float]],
                 mask_times: Callable[[], list[float]] = list, names: str = "both") -> None:
        self.names = names                   # which registries render() exports: both, vllm or pdserve
        self.vllm = VllmMetrics(stats)
        self.registry = CollectorRegistry()
        self._transfer_times, self._mask_times = transfer_times, mask_times
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between two tokens of one sequence",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.kv_transfer = Histogram("pdserve_kv_transfer_seconds", "Duration of one prefill-to-decode KV copy",
                                     buckets=TRANSFER_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("pdserve_requests_finished", "Finished engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.http_errors = Counter("pdserve_http_errors", "Error responses by status", ["status"], registry=r)
        self.structured = Counter("pdserve_structured_requests", "Requests with constrained output by kind "
                                  "(json, regex, choice, grammar, tools, logit_bias)", ["kind"], registry=r)
        self.grammar_compile = Histogram("pdserve_grammar_compile_seconds", "Building and checking one new "
                                         "grammar (cache misses only)", buckets=COMPILE_BUCKETS, registry=r)
        self.grammar_mask = Histogram("pdserve_grammar_mask_seconds", "Host time of one step's token masks "
                                      "(steps with constrained rows)", buckets=MASK_BUCKETS, registry=r)
        self.slo_checked = Counter("pdserve_requests_slo_checked", "Finished requests judged against the TTFT and "
                                   "ITL SLOs (finish reason stop, length or error; aborted ones are not)", registry=r)
        self.slo_met = Counter("pdserve_requests_slo_met", "Judged requests within the SLO: ttft, itl (their mean "
                               "inter-token latency), or both (goodput: rate() of slo=\"both\")", ["slo"], registry=r)
        self.slo_seconds = Gauge("pdserve_slo_seconds", "The SLOs in effect", ["slo"], registry=r)
        for reason in FinishReason:
            self.finished.labels(reason.value)
        for slo in ("ttft", "itl", "both"):
            self.slo_met.labels(slo)
        r.register(EngineCollector(stats))

    def bind_model(self, model_name: str, max_model_len: int, cache_info: dict[str, str]) -> None:
        """The served name the vLLM series carry (their model_name label), its context window and vLLM's
        cache_config_info labels."""
        self.vllm.bind(model_name, max_model_len, cache_info)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.observe("time_to_first_token_seconds", seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.observe("inter_token_latency_seconds", seconds)
        self.vllm.observe("time_per_output_token_seconds", seconds)

    def observe_finished(self, finish_reason: str, prompt_tokens: int, output_tokens: int, e2e: float,
                         mean_itl: float | None = None) -> None:
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(e2e)
        self.vllm.observe_finished(finish_reason, prompt_tokens, output_tokens, e2e, mean_itl)

    def observe_slos(self, slos: Slos, finish_reason: str, prompt_tokens: int, ttft: float | None,
                     itl: float | None) -> None:
        """Judge one finished request of `prompt_tokens` (`ttft` None: no token came; `itl` None: fewer than two
        tokens, met)."""
        self.slo_seconds.labels("ttft").set(slos.ttft)
        self.slo_seconds.labels("itl").set(slos.itl)
        if finish_reason == FinishReason.ABORT.value:
            return
        self.slo_checked.inc()
        ok = finish_reason != FinishReason.ERROR.value
        ttft_met = ok and ttft is not None and ttft <= slos.ttft_for(prompt_tokens)
        itl_met = ok and (itl is None or itl <= slos.itl)
        for slo, met in (("ttft", ttft_met), ("itl", itl_met), ("both", ttft_met and itl_met)):
            if met:
                self.slo_met.labels(slo).inc()

    def drain_transfer_times(self) -> None:
        for seconds in self._transfer_times():
            self.kv_transfer.observe(seconds)
        for seconds in self._mask_times():
            self.grammar_mask.observe(seconds)

    def render(self) -> bytes:
        self.drain_transfer_times()
        ours = generate_latest(self.registry) if self.names != "vllm" else b""
        return ours + (generate_latest(self.vllm.registry) if self.names != "pdserve" else b"")
