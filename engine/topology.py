"""Turn an EngineConfig into loaded models, sized KV pools and wired actors."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.actors.base import Actor, Emit
from engine.actors.colocated import ColocatedActor
from engine.actors.decode import DecodeActor
from engine.actors.prefill import PrefillActor
from engine.config import DTYPES, EngineConfig, ModelConfig
from engine.core.block_manager import blocks_for
from engine.model.quant import gguf_source, quantize_model
from engine.transfer.select import select_transfer
from engine.worker.memory import num_kv_blocks
from engine.worker.model_runner import ModelRunner, load_model

logger = logging.getLogger(__name__)

CPU_DEFAULT_DTYPE = "bfloat16"      # measured: bench/RESULTS.md, "CPU dtype"
PREFILL_SHARE_OF_SHARED_DEVICE = 0.25


@dataclass(frozen=True, slots=True)
class Plan:
    """Decisions made once at start-up."""

    mode: str
    prefill_device: torch.device
    decode_device: torch.device
    dtype: torch.dtype
    max_model_len: int
    prefill_cores: tuple[int, ...]
    decode_cores: tuple[int, ...]


def resolve_model_dir(model: str | None) -> Path:
    """A checkpoint directory; None or 'demo[:size[:arch]]' means the built-in demo model."""
    from engine.model.demo import default_model_dir

    if model is None or model.startswith("demo"):
        parts = (model or "demo").split(":")
        return default_model_dir(parts[1] if len(parts) > 1 else "base",
                                 parts[2] if len(parts) > 2 else "llama")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (no hub downloads: "
                                f"pass a local Hugging Face style directory, or omit --model for the demo)")
    return path


def make_plan(config: EngineConfig, model_config: ModelConfig) -> Plan:
    prefill, decode = torch.device(config.prefill_device), torch.device(config.decode_device)
    for device in (prefill, decode):
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
    mode = config.mode or ("disaggregated" if prefill != decode or prefill.type == "cpu" else "colocated")
    if mode not in ("disaggregated", "colocated"):
        raise ValueError(f"mode must be disaggregated or colocated, got {mode!r}")
    dtype_name = config.dtype or ("bfloat16" if decode.type == "cuda" else CPU_DEFAULT_DTYPE)
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
    limits = [model_config.max_position_embeddings, model_config.sliding_window or 1 << 30]
    max_model_len = min(limits + ([config.scheduler.max_model_len] if config.scheduler.max_model_len else []))
    prefill_cores, decode_cores = _split_cores(mode, config)
    return Plan(mode, prefill, decode if mode == "disaggregated" else prefill, DTYPES[dtype_name],
                max_model_len, prefill_cores, decode_cores)


def _split_cores(mode: str, config: EngineConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if mode == "colocated":
        return cores[:config.prefill_threads or len(cores)], ()
    half = max(len(cores) // 2, 1)
    prefill_n = config.prefill_threads or half
    decode_n = config.decode_threads or max(len(cores) - prefill_n, 1)
    if prefill_n + decode_n > len(cores):
        logger.warning("prefill (%d) + decode (%d) threads exceed the %d cores available; they will share",
                       prefill_n, decode_n, len(cores))
        return cores[:prefill_n], cores[-decode_n:]
    return cores[:prefill_n], cores[prefill_n:prefill_n + decode_n]


def build_actors(config: EngineConfig, model_config: ModelConfig, plan: Plan, eos: frozenset[int],
                 emit: Emit) -> list[Actor]:
    """Load the model(s) and wire the actors for `plan.mode`. Raises ValueError on a bad setting."""
    sched, cache = config.scheduler, config.cache
    per_seq = blocks_for(plan.max_model_len, cache.block_size)
    graph_batch = sched.max_num_seqs if config.cuda_graph else 0
    prefill_model = load_model(model_config, plan.dtype, plan.prefill_device, plan.max_model_len)
    if plan.mode == "colocated":
        _quantize(prefill_model, config, plan.prefill_cores)
        blocks = num_kv_blocks(cache.kv_cache_memory, 1.0, plan.prefill_device, model_config,
                               cache.block_size, plan.dtype, per_seq * sched.max_num_seqs)
        runner = ModelRunner(prefill_model, blocks, cache.block_size, eos, graph_batch, per_seq)
        return [ColocatedActor(runner, sched, cache.kv_watermark, plan.max_model_len, emit, plan.prefill_cores)]
    shared = plan.prefill_device == plan.decode_device
    decode_model = prefill_model if shared else load_model(model_config, plan.dtype, plan.decode_device,
                                                           plan.max_model_len)
    _quantize(decode_model, config, plan.decode_cores)      # NOTE: shared with prefill on one device
    prefill_share = PREFILL_SHARE_OF_SHARED_DEVICE if shared else 1.0
    prefill_blocks = num_kv_blocks(cache.kv_cache_memory, prefill_share, plan.prefill_device, model_config,
                                   cache.block_size, plan.dtype, per_seq * 4)
    decode_blocks = num_kv_blocks(cache.kv_cache_memory, 1.0 - prefill_share if shared else 1.0,
                                  plan.decode_device, model_config, cache.block_size, plan.dtype,
                                  per_seq * sched.max_num_seqs)
    decode_runner = ModelRunner(decode_model, decode_blocks, cache.block_size, eos, graph_batch, per_seq)
    decode = DecodeActor(decode_runner, sched,
                         cache.kv_watermark, plan.max_model_len, emit, plan.decode_cores)
    transfer = select_transfer(plan.prefill_device, plan.decode_device, config.kv_transfer)
    prefill = PrefillActor(ModelRunner(prefill_model, prefill_blocks, cache.block_size, eos), decode,
                           transfer, sched, plan.max_model_len, emit, plan.prefill_cores)
    decode.send_to_prefill = prefill.send
    decode.on_blocks_freed = prefill.poke
    return [prefill, decode]


def _quantize(model, config: EngineConfig, cores: tuple[int, ...]) -> None:
    if config.quantization != "none":
        quantize_model(model, config.quantization, gguf_source(config.model, model.config.model_dir),
                       max(len(cores), 1))
