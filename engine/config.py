"""Configuration, split by layer. Frozen: values computed at start-up are returned, not written back.

Each layer's config lives with its layer (`pdserve.engine.model.config`, `pdserve.engine.core.config`); this module
adds the engine-wide `EngineConfig` and re-exports the others for callers above the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core.config import CacheConfig, SchedulerConfig
from pdserve.engine.core.speculative import SpeculativeConfig
from pdserve.engine.model.config import (
    DTYPES,
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    ModelConfig,
    RopeConfig,
)

__all__ = ["CacheConfig", "ConfigError", "DTYPES", "EngineConfig", "ModelConfig", "RopeConfig",
           "SUPPORTED_ARCHITECTURES", "SchedulerConfig", "SpeculativeConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None          # None: SmolLM2 when installed, else the demo (engine.model.resolve)
    dtype: str | None = None          # None: chosen from the machine (engine.worker.startup.defaults)
    mode: str | None = None           # adaptive | disaggregated | colocated; None: adaptive (colocated on one core)
    prefill_device: str | None = None  # None: chosen from the machine (cuda:0 with a GPU, else cpu)
    decode_device: str | None = None   # None: cuda:1 with two GPUs, cuda:0 with one, else cpu
    prefill_threads: int | None = None
    decode_threads: int | None = None
    kv_transfer: str | None = None    # torch | cupy-p2p | staged; None: automatic
    cuda_graph: bool = True
    async_scheduling: bool | None = None   # schedule step N+1 while N runs; None: on for CUDA, off on CPU
    quantization: str = "auto"        # none | int8 | gguf | auto (engine.model.quant)
    cpu_kernels: str = "auto"         # auto | native | torch (engine.worker.startup.cpu_kernels)
    seed: int = 0
    workers: str = "thread"           # thread | process: where each actor's runner steps (engine.worker.compute)
    on_worker_failure: str = "restart"  # restart | exit (engine.supervisor)
    step_timeout: float = 120.0       # seconds one step may run before its actor counts as failed; 0: never
    distributed_executor_backend: str | None = None   # "ray": units are Ray actors (engine.ray); None: --workers
    ray_address: str | None = None    # the Ray cluster to join; None: Ray's own resolution ($RAY_ADDRESS, local)
    ray_kv_transport: str = "object-store"    # how Ray units move KV between nodes: object-store | gloo
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None   # drafts verified on the decode side; None: off
