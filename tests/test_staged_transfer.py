"""Two GPUs without peer access: cupy-p2p falls back to the staged copy through pinned host memory.

On CPU, `tests.fake_cuda` stands in for two CUDA devices (CPU tensors that say cuda:0 / cuda:1,
streams with vector clocks) and `fake_runtime` for cupy's runtime, so the real backends run: their
copies move real bytes, and every pair of copies that touch the same memory must be ordered.
"""
from __future__ import annotations

import ctypes
import logging
import random

import pytest
import torch

from pdserve.engine.transfer import cupy_p2p
from pdserve.engine.transfer.base import TransferUnavailable, coalesce_runs
from pdserve.engine.transfer.cupy_p2p import CupyP2PTransfer
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.transfer.staged import StagedTransfer, staging_pieces
from tests.fake_cuda import fake_cuda, races
from tests.test_kv_transfer import BLOCK_GEOMETRY, fake_runtime, random_pairs, reference_copy

CUDA0, CUDA1 = torch.device("cuda:0"), torch.device("cuda:1")
BLOCK_BYTES = torch.Size(BLOCK_GEOMETRY).numel() * 4     # float32 pools


def pools_on_two_devices(seed: int, src_blocks: int = 40, dst_blocks: int = 64):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randn(src_blocks, *BLOCK_GEOMETRY, generator=generator)
    dst = torch.randn(dst_blocks, *BLOCK_GEOMETRY, generator=generator)
    return src.to(CUDA0), dst.to(CUDA1), src, dst


@pytest.mark.parametrize("runs, per_piece, pieces", [
    ([], 3, []),
    ([(0, 10, 7)], 3, [(0, 10, 3), (3, 13, 3), (6, 16, 1)]),
    ([(5, 0, 2), (9, 4, 4)], 4, [(5, 0, 2), (9, 4, 4)]),
    ([(1, 1, 1)], 1, [(1, 1, 1)]),
])
def test_staging_pieces_cut_runs_to_the_slot(runs, per_piece, pieces):
    assert staging_pieces(runs, per_piece) == pieces


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("slot_blocks", [1, 3, 64])
def test_staged_copy_moves_the_blocks_in_order_between_two_devices(monkeypatch, seed, slot_blocks):
    with fake_cuda(monkeypatch) as cuda:
        src_pool, dst_pool, src_cpu, dst_cpu = pools_on_two_devices(seed)
        src_ids, dst_ids = random_pairs(random.Random(seed), 40, 64, 33)
        expected = reference_copy(src_cpu, dst_cpu, src_ids, dst_ids)
        fresh = torch.randn(src_pool.shape).to(CUDA0)
        producer = torch.cuda.current_stream(CUDA0)
        src_pool.copy_(fresh)                        # the caller's last write, on its own stream
        transfer = StagedTransfer(CUDA0, CUDA1, slot_bytes=slot_blocks * BLOCK_BYTES)
        handle = transfer.copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
        handle.wait()
        expected = reference_copy(fresh.cpu(), dst_cpu, src_ids, dst_ids)
        assert torch.equal(dst_pool.cpu(), expected)
        assert handle.nbytes == 33 * BLOCK_BYTES and handle.seconds is not None
        assert not races(cuda.copies), "two copies of the same bytes are not ordered"
        pieces = len(staging_pieces(coalesce_runs(src_ids, dst_ids), slot_blocks))
        streams = [c.stream for c in cuda.copies[1:]]
        assert [s.device for s in streams] == [CUDA0, CUDA1] * pieces     # out to the host, in to cuda:1
        assert not any(s is producer or s.default for s in streams)


def test_a_staged_copy_without_its_waits_is_caught_as_a_race(monkeypatch):
    """The race check has teeth: drop the destination's wait for the filled slot and it fires."""
    with fake_cuda(monkeypatch) as cuda:
        src_pool, dst_pool, _, _ = pools_on_two_devices(0)
        transfer = StagedTransfer(CUDA0, CUDA1, slot_bytes=2 * BLOCK_BYTES)
        monkeypatch.setattr(transfer._dst_stream, "wait_event", lambda event: None)
        transfer.copy_blocks(src_pool, dst_pool, list(range(10)), list(range(10)))
        assert races(cuda.copies)


def test_a_block_larger_than_the_slot_grows_the_slots(monkeypatch):
    with fake_cuda(monkeypatch):
        src_pool, dst_pool, src_cpu, dst_cpu = pools_on_two_devices(1)
        transfer = StagedTransfer(CUDA0, CUDA1, slot_bytes=BLOCK_BYTES // 2)
        transfer.copy_blocks(src_pool, dst_pool, [3, 4, 9], [0, 1, 2]).wait()
        assert torch.equal(dst_pool.cpu(), reference_copy(src_cpu, dst_cpu, [3, 4, 9], [0, 1, 2]))


def test_staged_checks_pools_and_ids(monkeypatch):
    with fake_cuda(monkeypatch):
        src_pool, dst_pool, _, _ = pools_on_two_devices(2)
        transfer = StagedTransfer(CUDA0, CUDA1)
        with pytest.raises(ValueError, match="source block ids"):
            transfer.copy_blocks(src_pool, dst_pool, [99], [0])
        with pytest.raises(ValueError, match="staged copies need contiguous pools on cuda:0 -> cuda:1"):
            transfer.copy_blocks(dst_pool, src_pool, [0], [0])
        assert transfer.copy_blocks(src_pool, dst_pool, [], []).done()


def test_without_peer_access_automatic_choice_is_staged_with_a_warning(monkeypatch, caplog):
    with fake_cuda(monkeypatch):
        monkeypatch.setattr(cupy_p2p, "import_cupy_runtime", lambda: fake_runtime(can_access_peer=False))
        with caplog.at_level(logging.WARNING, logger="pdserve.engine.transfer.select"):
            transfer = select_transfer(CUDA0, CUDA1)
        assert transfer.name == "staged"
        assert "cannot access each other as peers; copying through pinned host memory" in caplog.text


def test_forced_cupy_p2p_without_peer_access_is_staged_too(monkeypatch, caplog):
    with fake_cuda(monkeypatch):
        monkeypatch.setattr(cupy_p2p, "import_cupy_runtime", lambda: fake_runtime(enable_status=711))
        with caplog.at_level(logging.WARNING):
            assert select_transfer(CUDA0, CUDA1, forced="cupy-p2p").name == "staged"
        assert "cannot enable peer access cuda:0 -> cuda:1" in caplog.text


def test_without_cupy_non_peers_get_staged_and_peers_get_torch(monkeypatch):
    with fake_cuda(monkeypatch):
        monkeypatch.setattr(cupy_p2p, "import_cupy_runtime", _no_cupy)
        assert select_transfer(CUDA0, CUDA1).name == "torch"
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: False)
        assert select_transfer(CUDA0, CUDA1).name == "staged"
        with pytest.raises(TransferUnavailable, match="cupy is not importable"):
            select_transfer(CUDA0, CUDA1, forced="cupy-p2p")


def test_forced_staged(monkeypatch):
    with pytest.raises(TransferUnavailable, match="staged copies run between CUDA devices, got cpu and cpu"):
        select_transfer(torch.device("cpu"), torch.device("cpu"), forced="staged")
    with fake_cuda(monkeypatch):
        assert select_transfer(CUDA0, CUDA1, forced="staged").name == "staged"


def copying_runtime(fail_after: int | None = None):
    """fake_runtime whose memcpyPeerAsync moves the bytes (CPU addresses), failing after `fail_after` calls."""
    runtime = fake_runtime()
    calls = []

    def memcpy_peer_async(dst, dst_device, src, src_device, nbytes, stream):
        calls.append((dst_device, src_device, nbytes))
        if fail_after is not None and len(calls) > fail_after:
            raise runtime.CUDARuntimeError(700)      # cudaErrorIllegalAddress
        ctypes.memmove(dst, src, nbytes)

    runtime.memcpyPeerAsync, runtime.memcpy_calls = memcpy_peer_async, calls
    return runtime


def test_cupy_p2p_copies_each_coalesced_run_once(monkeypatch):
    with fake_cuda(monkeypatch):
        src_pool, dst_pool, src_cpu, dst_cpu = pools_on_two_devices(3)
        runtime = copying_runtime()
        src_ids, dst_ids = [0, 1, 2, 7, 5, 6], [10, 11, 12, 3, 20, 21]
        CupyP2PTransfer(runtime, CUDA0, CUDA1).copy_blocks(src_pool, dst_pool, src_ids, dst_ids).wait()
        assert torch.equal(dst_pool.cpu(), reference_copy(src_cpu, dst_cpu, src_ids, dst_ids))
        assert runtime.memcpy_calls == [(1, 0, 3 * BLOCK_BYTES), (1, 0, BLOCK_BYTES), (1, 0, 2 * BLOCK_BYTES)]


def test_a_failing_peer_copy_falls_back_to_staged_and_loses_nothing(monkeypatch, caplog):
    with fake_cuda(monkeypatch):
        src_pool, dst_pool, src_cpu, dst_cpu = pools_on_two_devices(4)
        runtime = copying_runtime(fail_after=1)
        transfer = CupyP2PTransfer(runtime, CUDA0, CUDA1)
        with caplog.at_level(logging.WARNING, logger="pdserve.engine.transfer.cupy_p2p"):
            transfer.copy_blocks(src_pool, dst_pool, [0, 1, 8, 20], [5, 6, 30, 2]).wait()
            transfer.copy_blocks(src_pool, dst_pool, [30, 31], [40, 41]).wait()
        expected = reference_copy(src_cpu, dst_cpu, [0, 1, 8, 20, 30, 31], [5, 6, 30, 2, 40, 41])
        assert torch.equal(dst_pool.cpu(), expected)
        assert caplog.text.count("copying KV blocks through pinned host memory from now on") == 1
        assert len(runtime.memcpy_calls) == 2                    # the second copy never tried peers again


def _no_cupy():
    raise TransferUnavailable("cupy is not importable: ImportError: no cupy here")



# CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("slot_blocks", [1, 7, 1000])
def test_staged_on_one_device_waits_for_the_producer(slot_blocks):
    from tests.test_kv_transfer import check_cuda_copy

    device = torch.device("cuda:0")
    block_bytes = torch.Size(BLOCK_GEOMETRY).numel() * 2          # check_cuda_copy's bf16 pools
    check_cuda_copy(StagedTransfer(device, device, slot_bytes=slot_blocks * block_bytes), device, device, seed=11)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_staged_between_two_devices():
    from tests.test_kv_transfer import check_cuda_copy

    check_cuda_copy(select_transfer(CUDA0, CUDA1, forced="staged"), CUDA0, CUDA1, seed=13)
