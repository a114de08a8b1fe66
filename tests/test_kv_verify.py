"""`--kv-verify`: every prefill-to-decode copy checked at both ends. A copy damaged once is made again and the
answers stay right; one damaged every time ends its request with an error and is never decoded."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from pdserve.engine.core.messages import FinishReason, Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.transfer.base import TransferHandle
from pdserve.engine.transfer.torch_copy import TorchTransfer
from pdserve.engine.worker.kv_verify import check_copies, fingerprints
from tests.models import SLOS_SET, demo_checkpoint, engine_config
from tests.test_engine_modes import assert_pools_free, collect, prompts, run_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class Damaging(TorchTransfer):
    """Copies, then flips one byte of the destination's first block, the first `times` copies."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def copy_blocks(self, src_pool, dst_pool, src_ids, dst_ids) -> TransferHandle:
        handle = super().copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
        if self.times and dst_ids:
            self.times -= 1
            dst_pool[dst_ids[0]].view(-1).view(torch.uint8)[123] ^= 0x10
        return handle


def pools():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 2, 2, 4, 2, 8, generator=generator), torch.zeros(8, 2, 2, 4, 2, 8)


def test_fingerprints_tell_a_flipped_or_moved_word():
    src, _ = pools()
    base = fingerprints(src, [1])
    flipped = src.clone()
    flipped[1].view(-1).view(torch.int32)[7] ^= 1
    swapped = src.clone()
    words = swapped[1].view(-1).view(torch.int32)
    words[[3, 4]] = words[[4, 3]]
    assert fingerprints(flipped, [1]) != base and fingerprints(swapped, [1]) != base
    assert fingerprints(src.clone(), [1]) == base


@pytest.mark.parametrize("times, mismatches, failed", [(0, 0, ()), (1, 1, ()), (2, 1, ("r",))])
def test_a_copy_that_differs_is_made_again_and_reported_if_it_differs_twice(times, mismatches, failed):
    src, dst = pools()
    transfer = Damaging(times)
    handle = transfer.copy_blocks(src, dst, [1, 2], [5, 6])
    check = check_copies([("r", handle, transfer, src, dst, (1, 2), (5, 6))])
    assert (check.mismatches, check.failed) == (mismatches, failed)
    assert torch.equal(dst[5:7], src[1:3]) == (not failed)


def verified_engine(times: int, workers: str = "thread") -> Engine:
    config = engine_config(demo_checkpoint(), mode="disaggregated", workers=workers, **SLOS_SET)
    engine = Engine(dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_verify=True)))
    if workers == "thread":
        step_runner = engine.units.prefills[0].step_runner
        step_runner.peers = tuple(peer._replace(transfer=Damaging(times)) for peer in step_runner.peers)
    return engine


async def all_requests(engine: Engine) -> list:
    return await asyncio.gather(*(collect(engine.submit(r)) for r in requests()))


def requests() -> list[Request]:
    return [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts([40, 70, 12], seed=4))]


@pytest.fixture(scope="module")
def expected():
    engine = Engine(engine_config(demo_checkpoint(), mode="disaggregated", **SLOS_SET))
    got = asyncio.run(run_engine(engine, all_requests(engine)))
    engine.close()
    return got


@pytest.mark.parametrize("damaged, workers", [(0, "thread"), (0, "process"), (1, "thread")],
                         ids=["thread", "process", "damaged-once-copied-again"])
def test_verified_hand_offs_give_the_same_answers(expected, damaged, workers):
    engine = verified_engine(damaged, workers)
    got = asyncio.run(run_engine(engine, all_requests(engine)))
    assert got == expected
    assert sum(a.kv_verify_mismatches for a in engine.stats().actors) == damaged
    assert_pools_free(engine)
    engine.close()


def test_a_hand_off_damaged_every_time_ends_its_request_with_an_error(expected):
    engine = verified_engine(1 << 30)
    got = asyncio.run(run_engine(engine, all_requests(engine)))
    assert all(reason == FinishReason.ERROR for _, reason in got)
    assert all(len(tokens) <= 1 for tokens, _ in got)          # at most the prefill unit's first token
    assert sum(a.kv_verify_mismatches for a in engine.stats().actors) >= 3
    assert_pools_free(engine)
    engine.close()
