"""Running one StepWork on a compute unit: the same code on an actor's thread or in a worker process.

`launch` queues the step and its KV copies and returns at once; `PendingOutcome.result()` waits for
the step's tokens (the read-back point). `run` is both, for callers that want the outcome now.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.engine.transfer.base import KVTransfer, TransferHandle
from pdserve.engine.worker.kv_verify import CopyCheck, check_copies
from pdserve.engine.worker.model_runner import ModelRunner
from pdserve.engine.worker.pending_step import PendingStep
from pdserve.engine.worker.step import StepResult, StepWork
from pdserve.engine.worker.tiers.copier import TierCopier, TierCopies, TierOutcome


@dataclass(frozen=True, slots=True)
class StepOutcome:
    result: StepResult
    copies: tuple[tuple[str, TransferHandle], ...]   # (BlockCopy.key, its handle), in order
    seconds: float                                    # wall time of the step's compute
    threads: int                                      # CPU threads it ran with
    mask_seconds: float = 0.0                         # host time of its token masks (grammars, logit_bias)
    tier: TierOutcome = TierOutcome()                 # how its KV tier copies went
    check: CopyCheck = CopyCheck()                    # what --kv-verify found in its copies


class Peer(NamedTuple):
    """A pool this runner's KV hand-offs go to, and how they are copied there."""

    transfer: KVTransfer
    pool: torch.Tensor


class StepRunner:
    """A runner, and where its KV hand-offs go (`peers[i]` for BlockCopy.peer i; none when it hands off nothing,
    None at a peer it does not copy to itself: a Ray unit's peer on another node), and its KV tiers' bytes."""

    def __init__(self, runner: ModelRunner, peers: tuple[Peer | None, ...] = (),
                 tiers: TierCopier | None = None, verify_copies: bool = False) -> None:
        """`verify_copies`: --kv-verify, each KV hand-off checked at both ends after the step."""
        self.runner, self.peers, self.tiers, self.verify_copies = runner, peers, tiers, verify_copies
        self.reads_back_later = runner.device.type == "cuda"     # NOTE: on CPU a step's work is its launch

    def run(self, work: StepWork) -> StepOutcome:
        outcome = self.launch(work).result()
        self.runner.settle()
        return outcome

    def launch(self, work: StepWork) -> PendingOutcome:
        if work.threads is not None and work.threads != torch.get_num_threads():
            torch.set_num_threads(work.threads)
        started = time.perf_counter()
        tier = self._tier_copies(work)
        if self.reads_back_later:
            pending = self.runner.launch(work.step)
        else:
            pending = PendingStep.done(work.step, self.runner.execute(work.step))
        seconds = time.perf_counter() - started
        copies = tuple((copy.key, self._copy(copy.peer, copy.src_blocks, copy.dst_blocks)) for copy in work.copies)
        checked = None
        if self.verify_copies and copies:
            checked = tuple((key, handle, self.peers[c.peer].transfer, self.runner.kv_pool, self.peers[c.peer].pool,
                             c.src_blocks, c.dst_blocks) for (key, handle), c in zip(copies, work.copies))
        return PendingOutcome(pending, copies, seconds, torch.get_num_threads(), self.runner.mask_seconds, tier,
                              checked)

    def _tier_copies(self, work: StepWork) -> TierCopies | None:
        if not (work.tier_saves or work.tier_loads):
            return None
        if self.tiers is None:
            raise RuntimeError("a step carries KV tier copies to a unit that has no KV tiers")
        return self.tiers.start(work.tier_saves, work.tier_loads, self._pool_of)

    def _pool_of(self, peer: int) -> torch.Tensor:
        return self.runner.kv_pool if peer < 0 else self.peers[peer].pool

    def _copy(self, peer: int, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...]) -> TransferHandle:
        transfer, pool = self.peers[peer]
        return transfer.copy_blocks(self.runner.kv_pool, pool, src_blocks, dst_blocks)


@dataclass(frozen=True, slots=True)
class PendingOutcome:
    """A launched StepWork: `result()` waits for its tokens (never on the thread that launches steps)."""

    pending: PendingStep
    copies: tuple[tuple[str, TransferHandle], ...]
    launch_seconds: float            # host time of the launch (all of the step's work on CPU)
    threads: int
    mask_seconds: float
    tier: TierCopies | None = None
    checked: tuple | None = None     # the copies --kv-verify checks once they have landed

    def result(self) -> StepOutcome:
        result = self.pending.result()
        on_cuda = self.pending.timer is not None and self.pending.timer.on_cuda
        seconds = self.pending.seconds if on_cuda else self.launch_seconds    # NOTE: the device's time on CUDA
        tier = self.tier.finish() if self.tier is not None else TierOutcome()
        check = check_copies(self.checked) if self.checked else CopyCheck()
        return StepOutcome(result, self.copies, seconds, self.threads, self.mask_seconds, tier, check)
