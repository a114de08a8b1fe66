import random
import sys
import types

import pytest
import torch

from pdserve.engine.transfer import cupy_p2p as kv_transfer_cupy
from pdserve.engine.transfer.base import TransferUnavailable, coalesce_runs
from pdserve.engine.transfer.cupy_p2p import (
    CupyP2PTransfer,
    enable_peer_access,
    import_cupy_runtime,
)
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.transfer.torch_copy import TorchTransfer

BLOCK_GEOMETRY = (3, 2, 4, 2, 8)   # layers, k/v, block_size, kv_heads, head_dim

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def make_pool(num_blocks, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    # pool: [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    return torch.randn(num_blocks, *BLOCK_GEOMETRY, generator=gen).to(dtype=dtype, device=device)


def reference_copy(src_pool, dst_pool, src_ids, dst_ids):
    expected = dst_pool.clone()
    for src, dst in zip(src_ids, dst_ids):
        expected[dst] = src_pool[src]
    return expected


def random_pairs(rng, src_blocks, dst_blocks, count):
    """Id lists mixing long consecutive stretches with shuffled ones, dst ids unique."""
    return partly_shuffled(rng, src_blocks, count), partly_shuffled(rng, dst_blocks, count)


def partly_shuffled(rng, num_blocks, count):
    ids = sorted(rng.sample(range(num_blocks), count))
    lo, hi = sorted((rng.randrange(count + 1), rng.randrange(count + 1)))
    middle = ids[lo:hi]
    rng.shuffle(middle)
    return ids[:lo] + middle + ids[hi:]


def expand_runs(runs):
    pairs = []
    for src, dst, length in runs:
        pairs += [(src + i, dst + i) for i in range(length)]
    return pairs


# coalesce_runs

@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([], [], []),
        ([7], [2], [(7, 2, 1)]),
        ([0, 1, 2], [3, 4, 5], [(0, 3, 3)]),
        ([0, 1, 5, 6], [10, 11, 12, 13], [(0, 10, 2), (5, 12, 2)]),
        ([0, 1, 2], [4, 5, 9], [(0, 4, 2), (2, 9, 1)]),
        ([3, 2, 1], [0, 1, 2], [(3, 0, 1), (2, 1, 1), (1, 2, 1)]),
        ([4, 5, 9, 10, 11], [0, 1, 2, 3, 4], [(4, 0, 2), (9, 2, 3)]),
    ],
)
def test_coalesce_runs_hand_cases(src, dst, runs):
    assert coalesce_runs(src, dst) == runs


@pytest.mark.parametrize("seed", range(20))
def test_coalesce_runs_random_ids_reconstruct_and_are_maximal(seed):
    rng = random.Random(seed)
    src, dst = random_pairs(rng, 64, 96, rng.randrange(1, 60))
    runs = coalesce_runs(src, dst)
    assert expand_runs(runs) == list(zip(src, dst))
    assert all(length >= 1 for _, _, length in runs)
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert not (s1 == s0 + n0 and d1 == d0 + n0), "two adjacent runs could have been merged"


def test_coalesce_runs_rejects_unequal_lengths():
    with pytest.raises(ValueError, match="3 source block ids but 2"):
        coalesce_runs([0, 1, 2], [0, 1])


# torch backend on CPU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_torch_backend_matches_per_block_loop(dtype, seed):
    rng = random.Random(seed)
    src_pool = make_pool(40, dtype, seed=2 * seed)
    dst_pool = make_pool(64, dtype, seed=2 * seed + 1)
    src_ids, dst_ids = random_pairs(rng, 40, 64, rng.randrange(1, 40))
    expected = reference_copy(src_pool, dst_pool, src_ids, dst_ids)

    handle = TorchTransfer().copy_blocks(src_pool, dst_pool, src_ids, dst_ids)

    assert torch.equal(dst_pool, expected)
    assert handle.nbytes == len(src_ids) * src_pool[0].numel() * src_pool.element_size()


def test_torch_backend_non_consecutive_ids():
    src_pool, dst_pool = make_pool(16, seed=1), make_pool(16, seed=2)
    src_ids, dst_ids = [9, 2, 14, 5, 6], [0, 11, 3, 8, 15]
    expected = reference_copy(src_pool, dst_pool, src_ids, dst_ids)
    TorchTransfer().copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
    assert torch.equal(dst_pool, expected)


def test_torch_backend_empty_list_copies_nothing():
    src_pool, dst_pool = make_pool(8, seed=3), make_pool(8, seed=4)
    before = dst_pool.clone()
    handle = TorchTransfer().copy_blocks(src_pool, dst_pool, [], [])
    assert handle.done() and handle.nbytes == 0
    assert torch.equal(dst_pool, before)


def test_cpu_handle_is_done_at_once_with_wall_time():
    src_pool, dst_pool = make_pool(8, seed=5), make_pool(8, seed=6)
    handle = TorchTransfer().copy_blocks(src_pool, dst_pool, [1, 2, 3], [4, 5, 6])
    assert handle.done()
    handle.wait()
    assert isinstance(handle.seconds, float) and handle.seconds >= 0.0


@pytest.mark.parametrize(
    "dst_pool, src_ids, dst_ids, message",
    [
        (torch.randn(8, 3, 2, 4, 2, 16), [0], [0], "geometry differs"),
        (torch.randn(8, 3, 2, 8, 2, 8), [0], [0], "geometry differs"),
        (torch.randn(8, *BLOCK_GEOMETRY, dtype=torch.float64), [0], [0], "dtypes differ"),
        (torch.randn(8, *BLOCK_GEOMETRY), [0, 1], [0], "2 source block ids but 1"),
        (torch.randn(8, *BLOCK_GEOMETRY), [8], [0], r"source block ids \[8\] out of range"),
        (torch.randn(8, *BLOCK_GEOMETRY), [-1], [0], "source block ids"),
        (torch.randn(4, *BLOCK_GEOMETRY), [0, 1], [2, 4], r"destination block ids \[4\] out of range"),
        (torch.randn(8, *BLOCK_GEOMETRY), [0, 1], [3, 3], "destination block ids repeat"),
    ],
)
def test_bad_geometry_or_ids_raise_value_error(dst_pool, src_ids, dst_ids, message):
    src_pool = make_pool(8, seed=7)
    before = dst_pool.clone()
    with pytest.raises(ValueError, match=message):
        TorchTransfer().copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
    assert torch.equal(dst_pool, before)


# backend choice

@pytest.mark.parametrize("src, dst", [("cpu", "cpu"), ("cpu", "cuda:0"), ("cuda:1", "cpu"), ("cuda:0", "cuda:0")])
def test_select_transfer_picks_torch_for_cpu_or_one_device(src, dst):
    assert select_transfer(torch.device(src), torch.device(dst)).name == "torch"


def test_forced_torch_is_honoured():
    assert select_transfer(torch.device("cpu"), torch.device("cpu"), forced="torch").name == "torch"


def test_forced_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="torch, cupy-p2p, staged"):
        select_transfer(torch.device("cpu"), torch.device("cpu"), forced="nccl")


def test_forced_cupy_p2p_on_cpu_says_why():
    with pytest.raises(TransferUnavailable, match="two different CUDA devices, got cpu and cpu"):
        select_transfer(torch.device("cpu"), torch.device("cpu"), forced="cupy-p2p")


def test_forced_cupy_p2p_without_cupy_says_why(monkeypatch):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.runtime"):
        monkeypatch.setitem(sys.modules, name, None)   # as if cupy were not installed
    with pytest.raises(TransferUnavailable, match="cupy is not importable"):
        select_transfer(torch.device("cuda:0"), torch.device("cuda:1"), forced="cupy-p2p")
    assert select_transfer(torch.device("cuda:0"), torch.device("cuda:1")).name == "torch"


def cupy_runtime_works():
    try:
        import_cupy_runtime()
    except TransferUnavailable:
        return False
    return True


@pytest.mark.skipif(cupy_runtime_works(), reason="CUDA works for CuPy here")
def test_cupy_with_unusable_cuda_falls_back_and_forced_says_why():
    pytest.importorskip("cupy")
    src, dst = torch.device("cuda:0"), torch.device("cuda:1")
    assert select_transfer(src, dst).name == "torch"
    with pytest.raises(TransferUnavailable, match="cupy is installed but CUDA is unusable: CUDARuntimeError"):
        select_transfer(src, dst, forced="cupy-p2p")


def fake_runtime(can_access_peer=True, enable_status=None, device_count=2):
    """A stand-in for cupy.cuda.runtime that records device switches and peer enabling."""
    error_type = type("CUDARuntimeError", (RuntimeError,), {"__init__": _fake_error_init})
    calls = []
    state = {"device": 0}

    def enable(peer):
        calls.append(("enable", state["device"], peer))
        if enable_status is not None:
            raise error_type(enable_status)

    return types.SimpleNamespace(
        CUDARuntimeError=error_type,
        calls=calls,
        getDeviceCount=lambda: device_count,
        getDevice=lambda: state["device"],
        setDevice=lambda index: state.update(device=index),
        deviceCanAccessPeer=lambda device, peer: int(can_access_peer),
        deviceEnablePeerAccess=enable,
    )


def _fake_error_init(self, status):
    RuntimeError.__init__(self, f"cudaError {status}")
    self.status = status


def test_forced_cupy_p2p_on_missing_device_says_why(monkeypatch):
    monkeypatch.setattr(kv_transfer_cupy, "import_cupy_runtime", lambda: fake_runtime(device_count=1))
    with pytest.raises(TransferUnavailable, match="cuda:1 does not exist: CUDA sees 1 device"):
        select_transfer(torch.device("cuda:0"), torch.device("cuda:1"), forced="cupy-p2p")


def test_enable_peer_access_ignores_already_enabled_and_restores_device():
    runtime = fake_runtime(enable_status=704)
    runtime.setDevice(1)
    enable_peer_access(runtime, 0, 1)
    assert runtime.calls == [("enable", 0, 1)]
    assert runtime.getDevice() == 1


def test_enable_peer_access_reports_other_errors():
    runtime = fake_runtime(enable_status=711)   # cudaErrorTooManyPeers
    with pytest.raises(TransferUnavailable, match="cannot enable peer access cuda:1 -> cuda:0"):
        enable_peer_access(runtime, 1, 0)
    assert runtime.getDevice() == 0


# CUDA

def copy_after_slow_producer(transfer, src_pool, dst_pool, src_ids, dst_ids, fresh):
    """Write `fresh` into src_pool on a producer stream behind a device-side delay, then start the copy
    from that stream: the copy sees the new values only if it waits on the caller's stream."""
    producer = torch.cuda.Stream(src_pool.device)
    producer.wait_stream(torch.cuda.current_stream(src_pool.device))
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)   # device cycles, not a host sleep
        src_pool.copy_(fresh)
        handle = transfer.copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
    handle.wait()
    return handle


def check_cuda_copy(transfer, src_device, dst_device, seed=0):
    rng = random.Random(seed)
    src_pool = make_pool(48, torch.bfloat16, src_device, seed=seed)
    dst_pool = make_pool(80, torch.bfloat16, dst_device, seed=seed + 1)
    fresh = make_pool(48, torch.bfloat16, src_device, seed=seed + 2)
    torch.cuda.synchronize(src_device)
    torch.cuda.synchronize(dst_device)
    src_ids, dst_ids = random_pairs(rng, 48, 80, 30)
    expected = reference_copy(fresh.cpu(), dst_pool.cpu(), src_ids, dst_ids)

    handle = copy_after_slow_producer(transfer, src_pool, dst_pool, src_ids, dst_ids, fresh)

    assert handle.done()
    assert isinstance(handle.seconds, float) and handle.seconds >= 0.0
    assert torch.equal(dst_pool.cpu(), expected)


@gpu
@needs_cuda
def test_torch_backend_on_one_cuda_device_waits_for_producer_and_completes_by_event():
    transfer = select_transfer(torch.device("cuda:0"), torch.device("cuda:0"))
    assert transfer.name == "torch"
    check_cuda_copy(transfer, torch.device("cuda:0"), torch.device("cuda:0"))


needs_cupy_cuda = pytest.mark.skipif(not cupy_runtime_works(), reason="CuPy cannot use CUDA here")


def peers_can_access() -> bool:
    return torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)


@gpu
@needs_cuda
@needs_cupy_cuda
def test_cupy_memcpy_peer_path_on_one_device():
    device = torch.device("cuda:0")
    check_cuda_copy(CupyP2PTransfer(import_cupy_runtime(), device, device), device, device, seed=3)


@gpu
@needs_cuda
@needs_two_gpus
@needs_cupy_cuda
@pytest.mark.skipif(not peers_can_access(), reason="cuda:0 cannot access cuda:1 as a peer")
def test_cupy_p2p_between_two_devices():
    src, dst = torch.device("cuda:0"), torch.device("cuda:1")
    transfer = select_transfer(src, dst)
    assert transfer.name == "cupy-p2p"
    check_cuda_copy(transfer, src, dst, seed=5)


@gpu
@needs_cuda
@needs_two_gpus
def test_torch_backend_between_two_devices():
    src, dst = torch.device("cuda:0"), torch.device("cuda:1")
    check_cuda_copy(select_transfer(src, dst, forced="torch"), src, dst, seed=7)
