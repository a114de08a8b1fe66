"""The KV tiers' bytes: records in host memory and in the disk tier's file, each checked on read, and a
runner's copies between its pool and them (on CPU, and on the fake CUDA runtime for the GPU path's order).

Every way a record can go wrong is tried: a write cut before its header, flipped bytes in a block or a header,
a truncated file, a file of another model or size, a second server on the same folder."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from pdserve.engine.core.kv_tiers import TierCopy
from pdserve.engine.worker.tiers.copier import TierCopier, block_array
from pdserve.engine.worker.tiers.cuda_copier import CudaTierCopier
from pdserve.engine.worker.tiers.disk import DiskTier, disk_tier_bytes, disk_tier_slots, tier_file
from pdserve.engine.worker.tiers.host import HostTier, host_tier_bytes, host_tier_slots
from pdserve.engine.worker.tiers.records import checksum, validity_key
from tests.fake_cuda import fake_cuda, races

KEY = validity_key({"model": "test"})
BLOCK_SHAPE = (2, 2, 4, 2, 8)                    # layers, k/v, block size, kv heads, head dim
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 4      # float32


def digest(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def random_block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def write(tier, slot: int, n: int, written_ns: int = 1) -> np.ndarray:
    data = random_block(n)
    tier.write(slot, digest(n), data, checksum(data), written_ns)
    return data


def read(tier, slot: int, n: int) -> np.ndarray | None:
    out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    return out if tier.read_into(slot, digest(n), out) else None


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier.own(tmp_path, 6, BLOCK_BYTES, KEY)
    yield tier
    tier.close()


def test_sizes_never_exceed_the_budget():
    for budget in (BLOCK_BYTES * 3, 10 << 20, 123_457):
        assert host_tier_bytes(host_tier_slots(budget, BLOCK_BYTES), BLOCK_BYTES) <= budget
        slots = disk_tier_slots(budget, BLOCK_BYTES)
        assert disk_tier_bytes(slots, BLOCK_BYTES) <= budget or slots == 0
    assert disk_tier_slots(10 << 20, BLOCK_BYTES) > 2000


def test_the_host_tier_returns_what_was_written_and_nothing_else():
    tier = HostTier.allocate(4, BLOCK_BYTES, KEY)
    data = write(tier, 1, 7)
    assert np.array_equal(read(tier, 1, 7), data)
    assert read(tier, 1, 8) is None                          # another hash: not this block
    assert read(tier, 2, 7) is None                          # a slot never written
    tier.blocks[1][5] ^= 0x40                                # a flipped bit
    assert read(tier, 1, 7) is None
    tier.headers[1][0] = 0                                    # a write cut before its header: blank
    assert read(tier, 1, 7) is None


def test_the_disk_tier_keeps_its_records_across_a_reopen_oldest_first(tmp_path, disk):
    blocks = {slot: write(disk, slot, 10 + slot, written_ns=100 - slot) for slot in (0, 3, 5)}
    disk.close()
    again = DiskTier.own(tmp_path, 6, BLOCK_BYTES, KEY)
    held, bad = again.scan()
    assert held == [(5, digest(15)), (3, digest(13)), (0, digest(10))] and bad == 0
    for slot, data in blocks.items():
        assert np.array_equal(read(again, slot, 10 + slot), data)
    again.close()


def test_flipped_bytes_in_a_block_fail_its_read_and_blank_its_header(disk):
    write(disk, 2, 5)
    with open(disk.path, "r+b") as f:
        f.seek(disk._blocks + 2 * disk._stride + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert read(disk, 2, 5) is None
    assert disk.scan() == ([], 0)                            # not found again


def test_a_damaged_header_is_dropped_and_counted_at_start(tmp_path, disk):
    write(disk, 1, 1)
    write(disk, 4, 4)
    with open(disk.path, "r+b") as f:
        f.seek(disk._headers + 4 * 128 + 40)                 # inside the block hash
        f.write(b"\xAA")
    disk.close()
    again = DiskTier.own(tmp_path, 6, BLOCK_BYTES, KEY)
    assert again.scan() == ([(1, digest(1))], 1)
    assert again.scan() == ([(1, digest(1))], 0)             # blanked: counted once
    again.close()


def test_a_truncated_file_reads_as_missing_or_bad_never_as_a_block(tmp_path, disk):
    for slot in range(6):
        write(disk, slot, slot)
    disk.close()
    path = tier_file(tmp_path, KEY)
    os.truncate(path, disk._blocks + 3 * disk._stride + 17)   # slots 3..5 lose their bytes
    again = DiskTier.own(tmp_path, 6, BLOCK_BYTES, KEY)
    assert os.path.getsize(path) == disk_tier_bytes(6, BLOCK_BYTES)
    assert [read(again, slot, slot) is not None for slot in range(6)] == [True] * 3 + [False] * 3
    again.close()
    with open(path, "ab") as f:
        f.write(b"grown past its size" * 1000)
    DiskTier.own(tmp_path, 6, BLOCK_BYTES, KEY).close()
    assert os.path.getsize(path) == disk_tier_bytes(6, BLOCK_BYTES)      # never more than its size


def test_a_file_for_another_key_or_size_is_never_read(tmp_path, disk):
    write(disk, 0, 0)
    disk.close()
    other = DiskTier.own(tmp_path, 6, BLOCK_BYTES, validity_key({"model": "another"}))
    assert other.path != disk.path and other.scan() == ([], 0)
    other.close()
    resized = DiskTier.own(tmp_path, 5, BLOCK_BYTES, KEY)     # another size: started again, empty
    assert resized.scan() == ([], 0)
    resized.close()


def test_a_second_server_on_the_same_folder_is_refused(tmp_path, disk):
    with pytest.raises(ValueError, match="in use by another pdserve"):
        DiskTier.own(tmp_path, 6, BLOCK_BYTES, KEY)


def pools(seed: int, blocks: int = 6) -> torch.Tensor:
    return torch.randn(blocks, *BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed))


def test_a_runner_saves_blocks_through_both_tiers_and_loads_them_back(tmp_path, disk):
    host = HostTier.allocate(4, BLOCK_BYTES, KEY)
    copier = TierCopier((host, disk))
    source, target, peer = pools(0), pools(1), pools(2)
    saves = [TierCopy(1, 0, 2, digest(1)), TierCopy(1, 1, 4, digest(1)), TierCopy(3, 1, 0, digest(3), peer=0)]
    pool_of = {-1: source, 0: peer}.__getitem__
    assert copier.start(saves, [], pool_of).finish().failed_saves == ()
    loads = [TierCopy(0, 0, 2, digest(1)), TierCopy(5, 1, 4, digest(1)), TierCopy(2, 1, 0, digest(3)),
             TierCopy(4, 1, 3, digest(9))]
    outcome = copier.start([], loads, {-1: target}.__getitem__).finish()
    assert outcome.bad_loads == (3,)                          # slot 3 of the disk holds nothing
    assert torch.equal(target[0], source[1]) and torch.equal(target[5], source[1])
    assert torch.equal(target[2], peer[3])


def test_a_failed_disk_write_is_reported_not_committed(tmp_path, disk):
    copier = TierCopier((disk,))
    os.close(disk.fd)
    disk.fd = os.open(disk.path, os.O_RDONLY)                 # writes now fail (EBADF)
    outcome = copier.start([TierCopy(0, 0, 1, digest(0))], [], {-1: pools(0)}.__getitem__).finish()
    assert outcome.failed_saves == (0,)


def test_on_a_gpu_a_save_is_read_before_the_step_overwrites_and_a_load_lands_before_it_reads(monkeypatch):
    host = HostTier.allocate(4, BLOCK_BYTES, KEY, pin=False)
    with fake_cuda(monkeypatch, 1) as cuda:
        torch.cuda.set_stream(torch.cuda.Stream(torch.device("cuda:0")))
        expected = pools(3)
        pool = pools(4).to("cuda:0")
        pool[2].copy_(expected[2].to("cuda:0"))                # an earlier step wrote the block
        copier = CudaTierCopier((host,), torch.device("cuda:0"))
        copies = copier.start([TierCopy(2, 0, 1, digest(2))], [], {-1: pool}.__getitem__)
        pool[2].copy_(torch.zeros(BLOCK_SHAPE).to("cuda:0"))  # the step's forward writes the block
        assert copies.finish().failed_saves == ()
        assert np.array_equal(host.blocks[1], block_array(expected, 2))
        loaded = copier.start([], [TierCopy(4, 0, 1, digest(2))], {-1: pool}.__getitem__)
        pool[4].cpu()                                         # the forward reads it
        assert loaded.finish().bad_loads == ()
        assert torch.equal(pool[4].cpu(), expected[2])
        assert races(cuda.copies) == []


def test_a_gpu_step_with_tier_copies_never_makes_the_host_wait(monkeypatch):
    """Saves and loads ride in the step's launch (inside the step window), their host side after it."""
    from pdserve.engine.worker.step import StepInput, StepWork
    from pdserve.engine.worker.step_runner import StepRunner
    from tests.test_step_sync import CUDA1, runner_on

    with fake_cuda(monkeypatch) as cuda:
        torch.cuda.set_device(CUDA1)
        torch.cuda.set_stream(torch.cuda.Stream(CUDA1))
        runner = runner_on(CUDA1)
        runner.kv_pool.copy_(torch.randn(runner.kv_pool.shape).to(CUDA1))
        block_bytes = runner.kv_pool[0].numel() * runner.kv_pool.element_size()
        host = HostTier.allocate(4, block_bytes, KEY, pin=True)
        step_runner = StepRunner(runner, (), CudaTierCopier((host,), CUDA1))
        saved = StepWork(StepInput(), tier_saves=(TierCopy(3, 0, 1, digest(3)),))
        step_runner.launch(saved).result()
        with cuda.step_window():
            pending = step_runner.launch(StepWork(StepInput(), tier_saves=(TierCopy(5, 0, 2, digest(5)),),
                                                  tier_loads=(TierCopy(7, 0, 1, digest(3)),)))
        outcome = pending.result()
        assert cuda.syncs == [] and outcome.tier.bad_loads == () and outcome.tier.failed_saves == ()
        assert torch.equal(runner.kv_pool[7].cpu(), runner.kv_pool[3].cpu())
        assert not torch.equal(runner.kv_pool[5].cpu(), runner.kv_pool[3].cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_real_gpu_blocks_round_trip_through_both_tiers_while_the_step_overwrites_them(tmp_path, disk):
    device = torch.device("cuda:0")
    stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(stream)
    host = HostTier.allocate(4, BLOCK_BYTES, KEY, pin=True)
    copier = CudaTierCopier((host, disk), device)
    expected = pools(5)
    pool = expected.to(device)
    copies = copier.start([TierCopy(2, 0, 1, digest(2)), TierCopy(2, 1, 3, digest(2))], [], {-1: pool}.__getitem__)
    pool[2].fill_(0.0)                                          # the forward overwrites the block at once
    assert copies.finish().failed_saves == ()
    loaded = copier.start([], [TierCopy(4, 0, 1, digest(2)), TierCopy(5, 1, 3, digest(2))], {-1: pool}.__getitem__)
    assert loaded.finish().bad_loads == ()
    torch.cuda.synchronize()
    assert torch.equal(pool[4].cpu(), expected[2]) and torch.equal(pool[5].cpu(), expected[2])
