"""The coordinator-worker messages: every StepWork and StepOutcome field survives a round trip,
another version or a damaged frame is refused, and two pools that disagree are refused by name."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.core.messages import PromptLogprobs, TokenLogprob
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.transfer.base import TransferHandle
from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.processes.shared_pool import PoolSpec, SharedPool, check_pools_agree
from pdserve.engine.worker.step import (
    BlockAppend,
    BlockCopy,
    ChunkInput,
    NewRow,
    StepInput,
    StepResult,
    StepWork,
    VerifyInput,
)
from pdserve.engine.worker.step_runner import StepOutcome
from pdserve.kernels.kv_layout import KVLayout

WORK = StepWork(
    StepInput(freed_rows=(3, 1),
              new_rows=(NewRow(0, (5, 6, 7), 2, (9, 4), SamplingParams(max_tokens=7, temperature=0.5, top_k=3,
                                                                         seed=11, stop=("x", "yz"),
                                                                         stop_token_ids=(2,), logprobs=2)),
                        NewRow(4, (8,), 1, (), SamplingParams(), 3)),
              appends=(BlockAppend(2, 5, (17, 18)),),
              decode_rows=(2, 5), decode_positions=(80, 12),
              chunks=(ChunkInput(0, 0, 3, True), ChunkInput(4, 0, 1, False, 0), ChunkInput(5, 16, 8, False, 20)),
              verify=(VerifyInput(6, 40, (3, 9, 9, 1)), VerifyInput(7, 8, (2, 5)))),
    copies=(BlockCopy("req-a", (1, 2), (30, 31)), BlockCopy("req-b", (7,), (9,))),
    threads=2)


def test_step_work_round_trips():
    assert wire.decode_work(wire.encode_work(WORK)) == WORK
    empty = StepWork(StepInput())
    assert wire.decode_work(wire.encode_work(empty)) == empty


def test_step_outcome_round_trips_with_landed_copies():
    result = StepResult((4, 9), (TokenLogprob(4, -0.5, ((4, -0.5), (3, -1.25))), None), ((9, 9, 2), (7,)),
                        ((TokenLogprob(9, -0.1, ((9, -0.1),)), TokenLogprob(9, -0.2), TokenLogprob(2, -3.0)), None),
                        prompt_logprobs=((1, PromptLogprobs((5, 8), (-2.5, -0.125), (7, 1),
                                                            (((3, -1.0),), ((8, -0.125),)))),
                                         (2, PromptLogprobs())))
    outcome = StepOutcome(result, (("req-a", TransferHandle.finished(4096, 0.002)),), 0.031, 2)
    back = wire.decode_outcome(wire.encode_outcome(outcome))
    assert back.result == result and (back.seconds, back.threads) == (0.031, 2)
    [(key, handle)] = back.copies
    assert key == "req-a" and handle.done() and (handle.nbytes, handle.seconds) == (4096, 0.002)


def test_another_version_a_wrong_kind_and_a_damaged_frame_are_refused(monkeypatch):
    frame = wire.encode_work(WORK)
    with pytest.raises(wire.WireError, match="expected a outcome frame"):
        wire.decode_outcome(frame)
    with pytest.raises(wire.WireError, match="does not match"):
        wire.decode_work(frame[:-3])
    sent_as = wire.VERSION
    monkeypatch.setattr(wire, "VERSION", sent_as + 1)
    with pytest.raises(wire.WireError, match=f"version {sent_as}"):
        wire.decode_work(frame)


def test_only_a_stop_frame_is_a_stop_and_a_damaged_one_is_not():
    assert wire.is_stop(wire.encode_message(wire.STOP))
    assert not wire.is_stop(wire.encode_work(WORK))
    assert not wire.is_stop(wire.encode_message(wire.STOP)[:-2])


def test_pools_that_disagree_are_refused_naming_both_values():
    layout = KVLayout(4, 16, 2, 64)
    check_pools_agree(PoolSpec(layout, 10, torch.float32), PoolSpec(layout, 99, torch.float32))  # sizes may differ
    with pytest.raises(ValueError, match="block size: prefill 16, decode 32"):
        check_pools_agree(PoolSpec(layout, 10, torch.float32), PoolSpec(KVLayout(4, 32, 2, 64), 10, torch.float32))
    with pytest.raises(ValueError, match="dtype: prefill torch.float32, decode torch.bfloat16"):
        check_pools_agree(PoolSpec(layout, 10, torch.float32), PoolSpec(layout, 10, torch.bfloat16))


def test_a_shared_pool_is_one_memory_seen_by_every_mapping():
    pool = SharedPool.create(PoolSpec(KVLayout(2, 16, 2, 8), 3, torch.bfloat16), "test")
    try:
        a, b = pool.tensor(), pool.tensor()
        a[2, 1, 0, 5] = 1.5
        assert b.shape == (3, 2, 2, 16, 2, 8) and b[2, 1, 0, 5].eq(1.5).all()
    finally:
        pool.close()
