"""Configuration of the KV cache and the schedulers (frozen: computed values are returned, not written back)."""
from __future__ import annotations

from dataclasses import dataclass

SLO_HEADROOM = 2.0           # a derived SLO: the measured step, and as much again for what rides along it
#                              (engine.coordinator.slo); a verify step's limit uses the same share (core.spec_policy)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: str | None = None   # bytes ("2GiB"), or a fraction of the memory free at start-up
    #                                      (CUDA: weights, activations, graphs and KV together); None:
    #                                      2GiB per CPU, 0.8 of each GPU's
    gpu_memory_utilization: float | None = None   # vLLM's meaning: the share of each GPU's total memory
    #                                      pdserve may use, weights and KV together (CUDA only; None: kv_cache_memory)
    kv_watermark: float = 0.9
    enable_prefix_caching: bool = True   # share the KV of identical prompt prefixes (full blocks)
    kv_offload_memory: int | None = None   # bytes of host memory for the KV tier below the pools; None: none
    kv_offload_disk: tuple[str, int] | None = None   # (folder, bytes) of the disk tier; None: none
    kv_verify: bool = False              # checksum every prefill-to-decode KV copy at both ends


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_prefill_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_queue: int = 1024
    ttft_slo_ms: float | None = None     # time to first token the planner aims for and goodput counts;
    #                                      None: derived at start-up (engine.coordinator.slo)
    itl_slo_ms: float | None = None      # time between two tokens of a stream, likewise
    itl_slo_kind: str = "mean"           # the planner's ITL miss: "mean" (a stream's mean gap, DistServe's TPOT)
    #                                      or "max" (any one gap: every step a stream waits for)
    startup_profile: bool = True         # time a few steps on the units at start: the cost models (routing, the
    #                                      planner) start from them, and an SLO not set is derived from them
    refresh_profile: bool = False        # measure the start-up profile again, not the one kept from a start before
