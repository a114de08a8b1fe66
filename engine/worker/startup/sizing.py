"""The start-up order for KV pools: free memory first, then weights, then a profile run, then the pools.

On CPU a pool is sized from its budget alone (`memory.num_kv_blocks`, 2 GiB by default); on CUDA
`memory_profile.kv_blocks` measures what else the device needs before the pool is allocated.
"""
from __future__ import annotations

import torch

from pdserve.engine.core.config import CacheConfig, SchedulerConfig
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.worker.memory import num_kv_blocks
from pdserve.engine.worker.startup.memory_profile import (
    CudaMemory,
    Demand,
    DeviceBudget,
    kv_blocks,
    weights_bytes,
)
from pdserve.engine.worker.startup.warmup import StepShape


def largest_steps(role: str, sched: SchedulerConfig, max_model_len: int) -> tuple[tuple[StepShape, ...], int]:
    """The steps of `role` that need the most working memory, and the most rows it samples at once."""
    budget = min(sched.max_prefill_tokens, max_model_len - 1)
    prefill = (StepShape("prefill", 1, budget), StepShape("prefill", min(sched.max_num_seqs, budget),
                                                          budget // min(sched.max_num_seqs, budget)))
    decode = (StepShape("decode", sched.max_num_seqs, 1, context=1),)
    if role == "prefill":
        return prefill, min(sched.max_num_seqs, budget)
    return (prefill if role == "colocated" else ()) + decode, sched.max_num_seqs


class PoolSizer:
    """Sizes one engine's pools. Build it before loading any model: it reads each GPU's free memory."""

    def __init__(self, cache: CacheConfig, sched: SchedulerConfig, model_config: ModelConfig, dtype: torch.dtype,
                 max_model_len: int, devices: set[torch.device], memory=CudaMemory, split: bool = False) -> None:
        """`split`: the pools' blocks hold the full layers only (`memory.kv_layout`)."""
        self.cache, self.sched, self.model_config, self.dtype = cache, sched, model_config, dtype
        self.split = split
        self.max_model_len = max_model_len
        self.memory = {d: memory(d) for d in devices if d.type == "cuda"}
        self.budgets = {d: DeviceBudget.at_start(d, cache.kv_cache_memory, m, cache.gpu_memory_utilization)
                        for d, m in self.memory.items()}
        weights = weights_bytes(model_config, dtype, max_model_len) if self.budgets else 0
        for budget in self.budgets.values():
            budget.check_weights(weights)

    def demand(self, role: str, model: CausalLM, share: float, max_useful_blocks: int,
               graph_batch: int = 0) -> Demand:
        steps, rows = largest_steps(role, self.sched, self.max_model_len)
        return Demand(model, share, max_useful_blocks, steps, rows, graph_batch)

    def blocks(self, device: torch.device, demands: list[Demand]) -> list[int]:
        """Blocks of each demand's pool on `device` (raises ValueError when they cannot fit)."""
        block_size = self.cache.block_size
        if device.type != "cuda":
            return [num_kv_blocks(self.cache.kv_cache_memory, d.share, device, self.model_config, block_size,
                                  self.dtype, d.max_useful_blocks, self.split) for d in demands]
        per_seq = -(-self.max_model_len // block_size)
        min_tokens = min(self.sched.max_prefill_tokens, self.max_model_len)
        return kv_blocks(self.budgets[device], demands, self.model_config, block_size, self.dtype, per_seq,
                         min_tokens, self.memory[device], self.split)
