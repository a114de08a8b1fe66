"""vLLM's metric names (`vllm:*`, labels model_name and engine), so a vLLM Grafana dashboard and llm-d's
endpoint picker read pdserve unchanged. Buckets and meanings are vLLM v1's; engine is always "0"."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.engine.core.messages import EngineStats, FinishReason

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to the context window."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class VllmCollector(Collector):
    """vLLM's scheduler gauges and prefix-cache counters, read from the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], labels: Callable[[], list[str] | None],
                 cache_info: Callable[[], dict[str, str]]) -> None:
        self._stats, self._labels, self._cache_info = stats, labels, cache_info

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats, labels = self._stats(), self._labels()
        if stats is None or labels is None:
            return
        decode_pools = [a for a in stats.actors if a.name != "prefill"] or list(stats.actors)
        total = sum(a.kv_blocks_total for a in decode_pools)
        usage = sum(a.kv_blocks_used for a in decode_pools) / total if total else 0.0
        for name, text, value in (
                ("num_requests_running", "Number of requests in model execution batches.", stats.running),
                ("num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
                ("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
                 "vllm:kv_cache_usage_perc instead.", usage)):
            yield _family(GaugeMetricFamily, name, text, labels, value)
        for name, text, field in (
                ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 "prefix_cache_queries"),
                ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
                ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_drafts"),
                ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_draft_tokens"),
                ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_accepted_tokens")):
            yield _family(CounterMetricFamily, name, text, labels, sum(getattr(a, field) for a in stats.actors))
        info = {**self._cache_info(), "engine": "0", "num_gpu_blocks": str(total)}
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=sorted(info))
        family.add_metric([info[k] for k in sorted(info)], 1.0)
        yield family


def _family(kind, name: str, text: str, labels: list[str], value: float):
    family = kind(f"vllm:{name}", text, labels=list(LABELS))
    family.add_metric(labels, float(value))
    return family


class VllmMetrics:
    """The per-request series under vLLM's names; `bind(model_name, max_model_len)` once the model is known."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self._labels: list[str] | None = None
        self._cache_info: dict[str, str] = {}
        self._series: dict[str, Counter | Histogram] = {}
        self.registry.register(VllmCollector(stats, lambda: self._labels, lambda: self._cache_info))

    def bind(self, model_name: str, max_model_len: int, cache_info: dict[str, str]) -> None:
        """`cache_info`: vllm:cache_config_info's labels but num_gpu_blocks (the decode-side pools', at scrape)."""
        if self._labels is not None:
            return
        self._labels, self._cache_info = [model_name, "0"], cache_info
        r, tokens = self.registry, token_buckets(max_model_len)
        for name, text, buckets in (
                ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
                ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
                ("time_per_output_token_seconds", "Histogram of time per output token in seconds. DEPRECATED: "
                 "Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS),
                ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
                 ITL_BUCKETS),
                ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS),
                ("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
                ("request_generation_tokens", "Number of generation tokens processed.", tokens)):
            self._series[name] = Histogram(f"vllm:{name}", text, LABELS, buckets=buckets, registry=r)
        for name, text in (("prompt_tokens", "Number of prefill tokens processed."),
                           ("generation_tokens", "Number of generation tokens processed.")):
            self._series[name] = Counter(f"vllm:{name}", text, LABELS, registry=r)
        self._series["request_success"] = Counter("vllm:request_success", "Count of successfully processed "
                                                  "requests.", (*LABELS, "finished_reason"), registry=r)
        for reason in FinishReason:
            self._series["request_success"].labels(*self._labels, reason.value)

    def observe(self, name: str, value: float) -> None:
        if self._labels is not None:
            self._series[name].labels(*self._labels).observe(value)

    def observe_finished(self, finish_reason: str, prompt_tokens: int, output_tokens: int, e2e: float,
                         mean_itl: float | None) -> None:
        if self._labels is None:
            return
        labels = self._labels
        self._series["request_success"].labels(*labels, finish_reason).inc()
        self._series["prompt_tokens"].labels(*labels).inc(prompt_tokens)
        self._series["generation_tokens"].labels(*labels).inc(output_tokens)
        for name, value in (("e2e_request_latency_seconds", e2e), ("request_prompt_tokens", prompt_tokens),
                            ("request_generation_tokens", output_tokens),
                            ("request_time_per_output_token_seconds", mean_itl)):
            if value is not None:
                self._series[name].labels(*labels).observe(value)
