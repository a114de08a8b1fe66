"""KV pool sizing on CUDA after a profile run, with faked memory readings; the CPU path is unchanged."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import ModelConfig, SchedulerConfig
from pdserve.engine.core.config import CacheConfig
from pdserve.engine.llm import LLM
from pdserve.engine.worker.sampling import sampling_filters
from pdserve.engine.worker.startup import memory_profile
from pdserve.engine.worker.memory import kv_block_bytes, num_kv_blocks
from pdserve.engine.worker.startup.memory_profile import (
    Demand,
    DeviceBudget,
    InsufficientMemory,
    Reserve,
    kv_blocks,
    measure_reserve,
    weights_bytes,
)
from pdserve.engine.worker.model_runner import load_model
from pdserve.engine.worker.startup.sizing import PoolSizer, largest_steps
from tests.fake_cuda import fake_cuda
from tests.models import demo_checkpoint, engine_config

GiB = 2**30
CUDA0 = torch.device("cuda:0")


class FakeMemory:
    """Scripted readings: `free` and `reserved` pop from their lists (the last value repeats)."""

    def __init__(self, free=(80 * GiB,), allocated=10 * GiB, peak=12 * GiB, reserved=(14 * GiB,), total=80 * GiB):
        self.free_values, self.reserved_values, self.total_value = list(free), list(reserved), total
        self.allocated_value, self.peak_value = allocated, peak
        self.calls = []

    def free(self):
        return self._next(self.free_values, "free")

    def reserved(self):
        return self._next(self.reserved_values, "reserved")

    def total(self):
        return self.total_value

    def _next(self, values, name):
        self.calls.append(name)
        return values.pop(0) if len(values) > 1 else values[0]

    def allocated(self):
        self.calls.append("allocated")
        return self.allocated_value

    def peak_allocated(self):
        self.calls.append("peak")
        return self.peak_value

    def reset_peak(self):
        self.calls.append("reset")

    def release_cached(self):
        self.calls.append("release")


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dir(demo_checkpoint())


@pytest.fixture(scope="module")
def cpu_model(config):
    return load_model(config, torch.float32, torch.device("cpu"), 256)


def demand(model, share=1.0, useful=10**9, role="colocated", sched=SchedulerConfig(max_num_seqs=4,
                                                                                   max_prefill_tokens=48)):
    steps, rows = largest_steps(role, sched, 256)
    return Demand(model, share, useful, steps, rows)


def test_weights_are_counted_without_allocating_them(config, cpu_model):
    expected = sum(t.numel() * t.element_size() for t in (*cpu_model.parameters(), *cpu_model.buffers()))
    assert weights_bytes(config, torch.float32, 256) == expected
    assert weights_bytes(config, torch.bfloat16, 256) < expected


def test_the_profile_measures_the_peak_of_the_largest_steps_and_the_worst_sampler(monkeypatch, cpu_model):
    rows = []
    real_sort = sampling_filters.top_k_top_p_sorted
    monkeypatch.setattr(sampling_filters, "top_k_top_p_sorted",
                        lambda x, k, p: rows.append(x.shape[0]) or real_sort(x, k, p))
    memory = FakeMemory(allocated=10 * GiB, peak=12 * GiB + 5)
    reserve = measure_reserve(demand(cpu_model), 16, 16, memory)
    assert reserve == Reserve(activations=2 * GiB + 5, graphs=0)
    assert memory.calls.index("allocated") < memory.calls.index("reset") < memory.calls.index("peak")
    assert max(rows) == 4, "the sampler's full-sort fallback ran on every row the demand can sample"


def test_the_profile_counts_the_decode_graphs_memory_on_their_device(monkeypatch, config):
    with fake_cuda(monkeypatch) as cuda:
        model = load_model(config, torch.float32, torch.device("cuda:1"), 256)
        memory = FakeMemory(reserved=(3 * GiB, 3 * GiB + 123_456_789))
        graph_demand = replace(demand(model, role="decode"), graph_batch=4)
        reserve = measure_reserve(graph_demand, 16, 16, memory)
        assert reserve.graphs == 123_456_789
        assert cuda.graphs and all(g.capture_stream.device == torch.device("cuda:1") for g in cuda.graphs)


def fixed_reserve(monkeypatch, activations, graphs):
    monkeypatch.setattr(memory_profile, "measure_reserve", lambda *args: Reserve(activations, graphs))


def test_a_fraction_gives_the_pool_what_weights_activations_and_graphs_leave(monkeypatch, config, cpu_model):
    fixed_reserve(monkeypatch, 2 * GiB, 1 * GiB)
    budget = DeviceBudget(CUDA0, 80 * GiB, None, 0.8)
    memory = FakeMemory(free=(70 * GiB,))                  # 10 GiB in use since start-up: weights, context
    [blocks] = kv_blocks(budget, [demand(cpu_model)], config, 16, torch.float32, 16, 48, memory)
    assert blocks == (64 - 10 - 3) * GiB // kv_block_bytes(config, 16, torch.float32)


def test_shares_split_one_device_between_two_pools(monkeypatch, config, cpu_model):
    fixed_reserve(monkeypatch, 1 * GiB, 0)
    budget = DeviceBudget(CUDA0, 40 * GiB, None, 0.5)
    block = kv_block_bytes(config, 16, torch.float32)
    prefill, decode = kv_blocks(budget, [demand(cpu_model, 0.25, useful=100), demand(cpu_model, 0.75)], config,
                                16, torch.float32, 16, 48, FakeMemory(free=(38 * GiB,)))
    assert (prefill, decode) == (100, int(16 * GiB * 0.75) // block)      # 20 - 2 in use - 2 x 1 reserved


def test_an_absolute_budget_is_the_pool_when_it_fits_beside_the_rest(monkeypatch, config, cpu_model):
    fixed_reserve(monkeypatch, 2 * GiB, 1 * GiB)
    budget = DeviceBudget(CUDA0, 80 * GiB, 4 * GiB, None)
    [blocks] = kv_blocks(budget, [demand(cpu_model)], config, 16, torch.float32, 16, 48, FakeMemory(free=(70 * GiB,)))
    assert blocks == 4 * GiB // kv_block_bytes(config, 16, torch.float32)
    with pytest.raises(InsufficientMemory, match=r"leave 67\.00 GiB free, less than the --kv-cache-memory of 68"):
        kv_blocks(replace(budget, absolute=68 * GiB), [demand(cpu_model)], config, 16, torch.float32, 16, 48,
                  FakeMemory(free=(70 * GiB,)))


def test_too_little_for_one_prefill_step_refuses_to_start_saying_what_took_the_memory(monkeypatch, config,
                                                                                       cpu_model):
    fixed_reserve(monkeypatch, 5 * GiB, 2 * GiB)
    budget = DeviceBudget(CUDA0, 24 * GiB, None, 0.8)
    memory = FakeMemory(free=(12 * GiB,))               # 12 GiB of weights: 19.2 - 12 - 7 = 0.2 GiB left
    with pytest.raises(InsufficientMemory) as error:
        kv_blocks(budget, [demand(cpu_model)], config, 16, torch.float32, 16, 10**9, memory)
    message = str(error.value)
    assert "cuda:0: weights and CUDA context 12.00 GiB, activations 5.00 GiB, CUDA graphs 2.00 GiB" in message
    assert "0.8 of the 24.00 GiB free at start-up" in message and "--no-cuda-graph" in message


def test_gpu_memory_utilization_is_a_share_of_the_whole_device_as_in_vllm(monkeypatch, config, cpu_model):
    fixed_reserve(monkeypatch, 2 * GiB, 1 * GiB)
    budget = DeviceBudget.at_start(CUDA0, None, FakeMemory(free=(50 * GiB,)), utilization=0.5)  # 30 GiB taken
    assert budget.limit() == 40 * GiB                                # half of 80, not half of the 50 free
    [blocks] = kv_blocks(budget, [demand(cpu_model)], config, 16, torch.float32, 16, 48,
                         FakeMemory(free=(44 * GiB,)))              # 6 GiB of weights since start-up
    assert blocks == (40 - 6 - 3) * GiB // kv_block_bytes(config, 16, torch.float32)
    with pytest.raises(InsufficientMemory, match=r"asks for 0.7 of the device's 80.00 GiB, but only 50.00 GiB"):
        DeviceBudget.at_start(CUDA0, None, FakeMemory(free=(50 * GiB,)), utilization=0.7)


def test_weights_larger_than_the_budget_are_refused_before_loading(config):
    weights = weights_bytes(config, torch.float32, 256)
    sizer_args = (CacheConfig(kv_cache_memory="0.5"), SchedulerConfig(), config, torch.float32, 256, {CUDA0})
    with pytest.raises(InsufficientMemory, match="cuda:0: the weights need .* GiB, more than 0.5 of the"):
        PoolSizer(*sizer_args, memory=lambda device: FakeMemory(free=(weights,)))
    PoolSizer(*sizer_args, memory=lambda device: FakeMemory(free=(4 * weights,)))


def test_cpu_pools_keep_the_2gib_default_and_read_no_gpu(config, cpu_model):
    sizer = PoolSizer(CacheConfig(), SchedulerConfig(), config, torch.float32, 256, {torch.device("cpu")},
                      memory=lambda device: pytest.fail("no GPU memory is read for a CPU device"))
    cpu = torch.device("cpu")
    [blocks] = sizer.blocks(cpu, [demand(cpu_model, useful=10**9)])
    assert blocks == num_kv_blocks(None, 1.0, cpu, config, 16, torch.float32, 10**9)
    assert blocks == 2 * GiB // kv_block_bytes(config, 16, torch.float32)


def test_an_engine_that_cannot_fit_a_pool_refuses_to_start_with_the_numbers(monkeypatch):
    with fake_cuda(monkeypatch) as cuda:
        cuda.free_memory[0] = 70 * 2**20
        cuda.memory_stats.update(allocated=1 * GiB, peak=1 * GiB + 63 * 2**20)       # 63 of the 63 MiB allowed
        config = engine_config(demo_checkpoint(), mode="colocated", prefill_device="cuda:0", decode_device="cuda:0",
                               kv_cache_memory="0.9", max_prefill_tokens=64)
        with pytest.raises(ValueError, match="cuda:0: weights and CUDA context .* activations 0.06 GiB"):
            LLM(config=config)
