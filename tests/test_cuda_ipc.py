"""CUDA IPC pools for `--workers process` on GPUs: export, open, refusals, and the wiring's choice.

On CPU, `tests.fake_cuda` stands in for the driver (an exported tensor is "opened" as itself; a
handle can be made to fail as cudaIpcOpenMemHandle does); the `gpu` tests open real handles in
spawned processes and serve with process workers on a real GPU.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle
from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.transfer.cuda_ipc import CudaIpcHandle, CudaIpcPool, CudaIpcUnavailable
from pdserve.engine.worker.memory import kv_layout
from pdserve.engine.worker.processes import shared_pool
from pdserve.engine.worker.processes.shared_pool import PoolSpec, SharedFd, SharedPool, open_shared, share_pool
from tests import fake_cuda as fake
from tests.fake_cuda import fake_cuda
from tests.models import demo_checkpoint, engine_config, layout_of

CUDA1 = torch.device("cuda:1")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def spec(num_blocks: int = 6) -> PoolSpec:
    return PoolSpec(kv_layout(ModelConfig.from_dir(demo_checkpoint()), 16), num_blocks, torch.float16)


def as_received(handle: CudaIpcHandle) -> CudaIpcHandle:
    """The handle as a worker process gets it: pickled, and opened from another pid."""
    return replace(pickle.loads(pickle.dumps(handle)), owner_pid=handle.owner_pid + 1)


def test_a_pool_exported_on_a_fake_gpu_opens_as_the_same_memory(monkeypatch):
    with fake_cuda(monkeypatch):
        pool = share_pool(spec(), CUDA1, "decode")
        assert isinstance(pool, CudaIpcPool) and pool.name == "cuda-ipc"
        assert pool.handle.device == "cuda:1" and pool.handle.nbytes == spec().nbytes
        opened = open_shared(spec(), as_received(pool.ticket))
        assert opened.device == CUDA1 and opened.shape == spec().layout.shape(6)
        opened[2].fill_(3.0)
        assert torch.equal(pool.tensor[2], torch.full_like(pool.tensor[2], 3.0))
        assert pool.tensor[1].abs().sum() == 0


def test_the_wiring_shares_cpu_pools_as_memfd_and_gpu_pools_as_cuda_ipc(monkeypatch):
    cpu_pool = share_pool(spec(), torch.device("cpu"), "decode")
    try:
        assert isinstance(cpu_pool, SharedPool) and isinstance(cpu_pool.ticket, SharedFd)
        assert shared_pool.sharing_for(torch.device("cpu")) == "memfd"
    finally:
        cpu_pool.close()
    with fake_cuda(monkeypatch):
        assert shared_pool.sharing_for(torch.device("cuda:0")) == "cuda-ipc"


def test_process_units_hand_cuda_ipc_handles_to_gpu_workers_and_memfds_to_cpu_workers(monkeypatch):
    from pdserve.engine.units import processes as process_units

    handed = []

    class Recorder:
        def __init__(self, spec, own_pool=None, peer_pools=()):
            handed.append((spec.name, spec.device, own_pool, peer_pools))

    monkeypatch.setattr(process_units, "ProcessCompute", Recorder)
    monkeypatch.setattr(process_units, "started", lambda units: units)
    config = replace(engine_config(demo_checkpoint(), workers="process"), cpu_kernels="torch")
    model_config = ModelConfig.from_dir(demo_checkpoint())
    for devices, ticket in ((("cuda:0", "cuda:1"), CudaIpcHandle), (("cpu", "cpu"), SharedFd)):
        handed.clear()
        layout = layout_of(config, model_config, "disaggregated", *devices)
        with fake_cuda(monkeypatch):
            units = process_units.load_process_units(config, model_config, layout, frozenset())
        (prefill, _, prefill_own, peers), (decode, decode_device, own, _) = handed
        assert (decode, prefill) == ("decode", "prefill") and decode_device == devices[1]
        assert isinstance(own, ticket) and prefill_own is None and len(peers) == 1 and isinstance(peers[0], ticket)
        if ticket is CudaIpcHandle:
            assert own.device == "cuda:1" and peers[0] == own
        for segment in units.shared:
            segment.close()


def test_a_handle_the_driver_cannot_open_is_refused_with_its_reason(monkeypatch):
    with fake_cuda(monkeypatch):
        pool = share_pool(spec(), CUDA1, "decode")
        fake.UNOPENABLE.add(pool.handle.args[0])
        try:
            with pytest.raises(CudaIpcUnavailable, match=r"cannot open the cuda:1 pool's CUDA IPC handle in "
                                                         r"process \d+: CUDA error: invalid resource handle"):
                open_shared(spec(), as_received(pool.ticket))
        finally:
            fake.UNOPENABLE.discard(pool.handle.args[0])


def test_opening_in_the_exporting_process_is_refused(monkeypatch):
    with fake_cuda(monkeypatch):
        pool = share_pool(spec(), CUDA1, "decode")
        with pytest.raises(CudaIpcUnavailable, match="opened in the process that exported it"):
            pool.ticket.open()


def test_without_cuda_or_the_device_a_handle_is_refused(monkeypatch):
    with fake_cuda(monkeypatch, device_count=2):
        received = as_received(share_pool(spec(), CUDA1, "decode").ticket)
    with fake_cuda(monkeypatch, device_count=1):
        with pytest.raises(CudaIpcUnavailable, match="sees 1 CUDA device.*CUDA_VISIBLE_DEVICES"):
            received.open()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CudaIpcUnavailable, match="CUDA is not available here"):
        received.open()
    with pytest.raises(CudaIpcUnavailable, match="CUDA is not available"):
        CudaIpcPool.create((4, 4), torch.float16, CUDA1)


def test_a_cpu_device_or_a_mismatched_pool_is_a_value_error(monkeypatch):
    with pytest.raises(ValueError, match="cpu is not a CUDA device"):
        CudaIpcPool.create((4, 4), torch.float16, torch.device("cpu"))
    with fake_cuda(monkeypatch):
        handle = as_received(share_pool(spec(6), CUDA1, "decode").ticket)
        with pytest.raises(ValueError, match="the shared CUDA pool is"):
            open_shared(spec(7), handle)


def test_an_export_the_allocator_refuses_is_reported(monkeypatch):
    with fake_cuda(monkeypatch):
        def refuse(tensor):
            raise RuntimeError("expandable segments do not support IPC")

        monkeypatch.setattr(torch.multiprocessing.reductions, "reduce_tensor", refuse)
        with pytest.raises(CudaIpcUnavailable, match="cannot export the KV pool on cuda:1 .* expandable segments"):
            CudaIpcPool.create((4, 4), torch.float16, CUDA1)


# on a GPU
def _write_blocks(handle: CudaIpcHandle, blocks: list[int], value: float, done) -> None:
    """In a spawned process: open the pool, fill `blocks` with `value`, report the sum of block 0."""
    pool = handle.open()
    for block in blocks:
        pool[block].fill_(value)
    torch.cuda.synchronize()
    done.put(float(pool[0].float().sum()))


@pytest.mark.gpu
@cuda
def test_a_spawned_process_writes_into_a_pool_this_process_reads():
    pool = CudaIpcPool.create((8, 2, 16, 64), torch.float16, torch.device("cuda:0"))
    pool.tensor[0].fill_(1.0)
    torch.cuda.synchronize()
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    child = context.Process(target=_write_blocks, args=(pool.handle, [3, 5], 2.5, done))
    child.start()
    seen_by_child = done.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0 and seen_by_child == pool.tensor[0].numel()
    assert torch.all(pool.tensor[3] == 2.5) and torch.all(pool.tensor[5] == 2.5)
    assert torch.all(pool.tensor[4] == 0) and torch.all(pool.tensor[0] == 1.0)


@pytest.mark.gpu
@cuda
def test_opening_a_real_handle_in_its_own_process_is_refused():
    pool = CudaIpcPool.create((2, 8), torch.float16, torch.device("cuda:0"))
    with pytest.raises(CudaIpcUnavailable, match="opened in the process that exported it"):
        pool.handle.open()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["disaggregated"])       # NOTE: the mode that shares a pool; the others own theirs
def test_process_workers_on_one_gpu_give_the_thread_workers_tokens(mode):
    from pdserve.engine.core.messages import Request
    from pdserve.engine.engine import Engine
    from tests.test_engine_modes import collect, prompts, run_engine
    from tests.test_supervisor import SHORT

    prompts_ = prompts([5, 90, 30, 200], seed=3)

    async def greedy(engine):
        results = await asyncio.gather(*(collect(engine.submit(Request(f"g{i}", p, SHORT)))
                                         for i, p in enumerate(prompts_)))
        return [tokens for tokens, _ in results]

    outputs = {}
    for workers in ("thread", "process"):
        engine = Engine(engine_config(demo_checkpoint(), mode=mode, workers=workers, prefill_device="cuda:0",
                                      decode_device="cuda:0", kv_cache_memory="256MiB"))
        try:
            outputs[workers] = asyncio.run(run_engine(engine, greedy(engine)))
        finally:
            engine.close()
    assert outputs["process"] == outputs["thread"]
    assert all(len(tokens) == SHORT.max_tokens for tokens in outputs["process"])
