"""What a model with recurrent layers (Qwen3-Next, Qwen3.5) changes in how the engine serves it.

Each sequence's state lives in one slot of its unit's pool (`engine.worker.state_pool`), so: a prefix found in
the cache would need that state as it was at the prefix's last block, which is not kept (prefix caching, and
the KV tiers that keep its blocks, are off for these models, said once); a draft verified in one step would
need a state per draft (speculative decoding is refused); CUDA graphs are not captured (the state kernels'
slots are not in the graph's buffers).
"""
from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.engine.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def serving_config(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """`config` as a model with recurrent layers is served (itself for any other model)."""
    if model.linear_attention is None:
        return config
    if config.speculative is not None:
        raise ValueError(f"--speculative-config: {model.name}'s recurrent layers keep one state per sequence, "
                         f"which a step verifying several drafts would need per draft; not supported")
    cache = config.cache
    if cache.enable_prefix_caching:
        tiers = cache.kv_offload_memory or cache.kv_offload_disk
        logger.info("prefix caching is off for %s%s: its recurrent layers' state at a cached prefix's end is not "
                    "kept", model.name, ", and with it the KV tiers" if tiers else "")
    cache = replace(cache, enable_prefix_caching=False, kv_offload_memory=None, kv_offload_disk=None)
    return replace(config, cache=cache, cuda_graph=False)
