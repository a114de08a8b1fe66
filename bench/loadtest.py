"""`pdserve bench`: load-test any OpenAI-compatible streaming endpoint.

    python -m pdserve.bench.loadtest --base-url http://127.0.0.1:8000 --dataset-name mixed \\
        --num-prompts 200 --request-rate 4 --slo ttft_ms=500 tpot_ms=50 \\
        --result-json out.json --plot out.png

Flag names and the summary table follow vLLM's `vllm bench serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import aiohttp
from tqdm import tqdm

from pdserve.bench.documents import arguments_dict, result_document, write_json
from pdserve.bench.metrics import (
    LATENCY_METRICS,
    BenchResult,
    RequestRecord,
    format_summary,
    parse_slo,
    summarize,
)
from pdserve.bench.multiturn import MULTITURN, benchmark_conversations, build_conversations, warmup_requests
from pdserve.bench.optional import require_plotting
from pdserve.bench.server_metrics import prefix_cache_delta, scrape_prefix_cache, spec_decode_delta
from pdserve.bench.sse_client import LENGTH_CONTROLS, EndpointConfig, send_request
from pdserve.bench.turn_metrics import format_turns, turn_summary
from pdserve.bench.workloads import (
    SampleRequest,
    TrafficSpec,
    WorkloadSpec,
    add_traffic_arguments,
    add_workload_arguments,
    arrival_offsets,
    build_workload,
    traffic_from_args,
    warmup_spec,
    workload_from_args,
)


class BenchError(Exception):
    """The benchmark could not run (server unreachable, no model listed)."""


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("endpoint")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://host:8000")
    group.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    group.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    group.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    group.add_argument("--length-control", choices=LENGTH_CONTROLS, default="vllm",
                       help="how output lengths are pinned: vllm = max_tokens+min_tokens+ignore_eos; "
                            "generation-config = transformers serve's generation_config; max-tokens = max_tokens only")
    group.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: server's)")
    group.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into every request")
    group.add_argument("--require-done", action=argparse.BooleanOptionalAction, default=True,
                       help="count a stream as complete only after data: [DONE] (--no-require-done: a "
                            "finish_reason and a clean end of stream suffice)")
    group.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request, all included")


def add_metric_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument("--slo", "--goodput", nargs="+", default=None, metavar="NAME_ms=VALUE",
                       help="goodput counts requests per second meeting all of: ttft_ms, itl_ms (every gap of the "
                            "stream), tpot_ms, e2el_ms; e.g. --slo ttft_ms=500 itl_ms=100")
    group.add_argument("--percentile-metrics", default=",".join(LATENCY_METRICS))
    group.add_argument("--metric-percentiles", default="90,99")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every `pdserve bench` flag on `parser`."""
    add_endpoint_arguments(parser)
    add_workload_arguments(parser)
    add_traffic_arguments(parser)
    add_metric_arguments(parser)
    group = parser.add_argument_group("output")
    group.add_argument("--result-json", default=None, help="write every per-request figure, the summary and the args")
    group.add_argument("--plot", default=None, help="PNG of TTFT/ITL CDFs and ITL over time")
    group.add_argument("--label", default=None, help="name of this run in the plot and JSON")
    group.add_argument("--disable-tqdm", action="store_true")


def metric_options(args: argparse.Namespace) -> tuple[dict[str, float], tuple[float, ...], tuple[str, ...]]:
    """(slo, percentiles, metrics) from the metric flags; raises ValueError on bad values."""
    slo = parse_slo(args.slo or ())
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(metrics) - set(LATENCY_METRICS)
    if unknown or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"bad --percentile-metrics {sorted(unknown)} or --metric-percentiles {percentiles}")
    return slo, percentiles, metrics


async def _warm_up(session: aiohttp.ClientSession, endpoint: EndpointConfig,
                   samples: Iterable[SampleRequest]) -> None:
    for index, sample in enumerate(samples):
        record = await send_request(session, endpoint, sample, index, time.perf_counter())
        if not record.success:
            print(f"warm-up request {index} failed: {record.error}", file=sys.stderr)


async def _limited(semaphore: asyncio.Semaphore | None, coroutine):
    if semaphore is None:
        return await coroutine
    async with semaphore:
        return await coroutine


def _cancelled_record(index: int, sample: SampleRequest, offset: float) -> RequestRecord:
    return RequestRecord(index, sample.kind, sample.prompt_len, sample.output_len, offset, success=False,
                         error="cancelled: still running at the overall bound (--duration + --request-timeout)")


Scheduled = tuple[int, SampleRequest, float]  # (index, sample, due offset in s)


async def benchmark(
    endpoint: EndpointConfig,
    samples: Iterable[SampleRequest],
    traffic: TrafficSpec,
    warmups: Iterable[SampleRequest] = (),
    progress: bool = True,
) -> BenchResult:
    """Send `samples` on `traffic`'s schedule and record each request.

    Stops sending after `num_prompts` requests or `duration` seconds. With a
    duration, requests still running `request_timeout` seconds after it are
    cancelled and recorded as failures, so a stalled server cannot hang the run.
    """
    connector = aiohttp.TCPConnector(limit=traffic.max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _warm_up(session, endpoint, warmups)
        before = await scrape_prefix_cache(session, endpoint)
        with tqdm(total=None if traffic.duration else traffic.num_prompts, disable=not progress, unit="req") as bar:
            origin = time.perf_counter()
            tasks = await _send_all(session, endpoint, samples, traffic, origin, bar)
            records = await _collect(tasks, _bound(traffic, endpoint, origin))
            duration = time.perf_counter() - origin
        after = await scrape_prefix_cache(session, endpoint)
    return BenchResult(tuple(sorted(records, key=lambda r: r.index)), duration, prefix_cache_delta(before, after),
                       origin, spec_decode_delta(before, after))


async def _send_all(session: aiohttp.ClientSession, endpoint: EndpointConfig, samples: Iterable[SampleRequest],
                    traffic: TrafficSpec, origin: float, bar: tqdm) -> dict[asyncio.Task, Scheduled]:
    semaphore = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    offsets = arrival_offsets(traffic.request_rate, traffic.burstiness, traffic.seed)
    tasks: dict[asyncio.Task, Scheduled] = {}
    for index, sample, offset in zip(range(traffic.num_prompts), samples, offsets):
        if traffic.duration is not None and max(offset, time.perf_counter() - origin) >= traffic.duration:
            break
        await asyncio.sleep(max(0.0, origin + offset - time.perf_counter()))
        task = asyncio.create_task(_limited(semaphore, send_request(session, endpoint, sample, index, origin)))
        task.add_done_callback(lambda _: bar.update(1))
        tasks[task] = (index, sample, offset)
    return tasks


def _bound(traffic: TrafficSpec, endpoint: EndpointConfig, origin: float) -> float | None:
    if traffic.duration is None:
        return None
    return max(0.0, origin + traffic.duration - time.perf_counter()) + endpoint.request_timeout


async def _collect(tasks: dict[asyncio.Task, Scheduled], bound: float | None) -> list[RequestRecord]:
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=bound)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() for task in done] + [_cancelled_record(*tasks[task]) for task in pending]


async def resolve_model(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The id of the first model the server lists at GET /v1/models.

    Raises BenchError when the server cannot be reached, answers badly or lists none.
    """
    url = f"{base_url.rstrip('/').removesuffix('/v1')}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url, headers=headers) as response:
                response.raise_for_status()
                return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, LookupError, TypeError) as error:
        raise BenchError(f"cannot list models at {url}: {type(error).__name__}: {error}") from None


def endpoint_from_args(args: argparse.Namespace, model: str) -> EndpointConfig:
    return EndpointConfig(
        base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
        length_control=args.length_control, temperature=args.temperature, extra_body=args.extra_body or {},
        require_done=args.require_done, request_timeout=args.request_timeout,
    )


@dataclass(frozen=True, slots=True)
class Options:
    """Everything the flags say besides the endpoint, validated."""

    workload: WorkloadSpec
    traffic: TrafficSpec
    slo: dict[str, float]
    percentiles: tuple[float, ...]
    metrics: tuple[str, ...]


def options_from_args(args: argparse.Namespace) -> Options:
    """Workload, traffic and metric options; raises ValueError (OSError for a dataset file) on bad ones."""
    workload = workload_from_args(args)
    if workload.name == MULTITURN:
        build_conversations(workload)  # validates
    else:
        build_workload(workload)  # validates, loads a dataset file
    return Options(workload, traffic_from_args(args), *metric_options(args))


def workload_endpoint(endpoint: EndpointConfig, workload: WorkloadSpec) -> EndpointConfig:
    """The endpoint a workload is sent to: multi-turn chat and edit instructions always go to /v1/chat/completions."""
    return replace(endpoint, endpoint="chat") if workload.name in (MULTITURN, "edit") else endpoint


async def run_workload(endpoint: EndpointConfig, options: Options, progress: bool = True) -> BenchResult:
    """Warm up, then run `options`' workload on its traffic against `endpoint`."""
    workload, traffic = options.workload, options.traffic
    if workload.name == MULTITURN:
        warmups = warmup_requests(workload, traffic.num_warmups)
        return await benchmark_conversations(endpoint, workload, traffic, warmups, progress)
    warmups = itertools.islice(build_workload(warmup_spec(workload)), traffic.num_warmups)
    return await benchmark(endpoint, build_workload(workload), traffic, warmups, progress)


def summarize_run(result: BenchResult, options: Options) -> dict:
    """`pdserve.bench.metrics.summarize` of a run with `options`' SLO, percentiles and metrics, and its per-turn
    and prefix-cache figures (`pdserve.bench.turn_metrics.turn_summary`)."""
    summary = summarize(result.records, result.duration, options.slo, options.percentiles, options.metrics)
    return summary | turn_summary(result.records, result.prefix_cache) | {"spec_decode": result.spec_decode}



def format_spec_decode(spec: dict) -> str:
    """The server's speculative decoding over the run: acceptance rate and tokens per verification."""
    rate, length = spec["acceptance_rate"], spec["mean_acceptance_length"]
    return (f"{'Draft acceptance rate (server):':<40}{'n/a' if rate is None else f'{rate:.1%}'} of "
            f"{spec['draft_tokens']:.0f} draft tokens; "
            f"{'n/a' if length is None else f'{length:.2f}'} tokens per verification")

async def _run(args: argparse.Namespace, options: Options) -> int:
    model = args.model or await resolve_model(args.base_url, args.api_key)
    endpoint = workload_endpoint(endpoint_from_args(args, model), options.workload)
    result = await run_workload(endpoint, options, progress=not args.disable_tqdm)
    if not result.records:
        print("no request was sent (check --num-prompts / --duration)", file=sys.stderr)
        return 1
    summary = summarize_run(result, options)
    print(format_summary(summary, options.percentiles))
    print(format_turns(summary))
    if summary["spec_decode"] is not None:
        print(format_spec_decode(summary["spec_decode"]))
    label = args.label or f"{endpoint.model} @ {endpoint.base_url}"
    if args.result_json:
        document = result_document(label, endpoint, options.traffic, options.workload, summary,
                                   result.records, arguments_dict(args))
        write_json(args.result_json, document)
    if args.plot:
        from pdserve.bench.plot import plot_runs

        plot_runs([(label, result.records)], args.plot)
    return 0 if summary["completed"] else 1


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed flags describe; print the summary table.

    Returns 0 when at least one request succeeded, 1 when none did or the
    server could not be reached, 2 on invalid flags or an unreadable dataset.
    """
    try:
        options = options_from_args(args)
        if args.extra_body is not None and not isinstance(args.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        if args.plot:
            require_plotting("--plot")
    except (ValueError, OSError) as error:
        print(f"pdserve bench: error: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, options))
    except BenchError as error:
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.bench.loadtest`: parse `argv` (default sys.argv[1:]) and run."""
    parser = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
