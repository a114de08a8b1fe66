"""The body of a worker process (`--workers process`): build one runner, then run steps as they come.

Spawned (never forked: a fresh interpreter, no inherited threads or locks) by
`pdserve.engine.worker.processes.process.ProcessCompute`, it dies with its parent, pins itself to
its cores, loads the model, maps the shared pools, and answers each step message with one outcome
(or error) message. A step's KV copies into the shared decode pool land before its outcome is sent.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.engine.core.state_slots import StateSlots
from pdserve.engine.core.window_slots import WindowSlots
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.transfer.select import select_transfer
from pdserve.engine.worker.processes import wire
from pdserve.engine.worker.startup.cpu_kernels import prepare_cpu_kernels
from pdserve.engine.worker.faults import Fault
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.processes.shared_pool import PoolSpec, SharedFd, check_pools_agree, open_shared
from pdserve.engine.worker.processes.shared_tiers import TierTicket, open_tiers
from pdserve.engine.worker.state_pool import carve_state_slots
from pdserve.engine.worker.window_pool import carve_window_slots
from pdserve.engine.worker.step_runner import Peer, StepRunner
from pdserve.engine.worker.startup.warmup import warm_up_for_serving
from pdserve.engine.worker.tiers.cuda_copier import tier_copier

PARENT_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build its runner; sent once, at spawn."""

    name: str                        # prefill, decode or colocated (log lines, the fault hook)
    model_config: ModelConfig
    dtype: torch.dtype
    device: str
    max_model_len: int
    pool: PoolSpec
    eos_token_ids: frozenset[int]
    step_sizes: dict
    cores: tuple[int, ...]
    quantization: str
    warmup_role: str
    scheduler: SchedulerConfig
    peer_pools: tuple[PoolSpec, ...] = ()   # the decode pools this worker copies finished blocks into
    kv_transfer: str | None = None
    log_level: int = logging.INFO
    cpu_kernels: str = "auto"        # the coordinator's --cpu-kernels decision (native | torch), applied here
    thread_counts: tuple[int, ...] = ()   # CPU threads a step may run with (warmed at load); () = len(cores)
    tiers: TierTicket | None = None  # the KV tiers this worker copies blocks to and from
    kv_verify: bool = False          # check each KV hand-off at both ends (--kv-verify)
    window_seqs: int = 0             # Layout.window_seqs

    def state_slots(self) -> StateSlots | None:
        """Where its runner keeps the recurrent states (a model with recurrent layers): a slot per sequence."""
        return carve_state_slots(self.model_config, self.pool.layout, self.dtype, self.pool.num_blocks,
                                 self.scheduler.max_num_seqs)

    def window_slots(self) -> WindowSlots | None:
        """Where its runner keeps the sliding layers' K and V apart (Layout.window_seqs), else None."""
        if not (self.window_seqs and self.model_config.split_window):
            return None
        blocks_per_seq = self.step_sizes.get("max_blocks_per_seq") or self.pool.num_blocks
        return carve_window_slots(self.model_config, self.pool.layout.block_size, self.pool.num_blocks,
                                  self.window_seqs, blocks_per_seq)


def worker_main(conn, spec: WorkerSpec, parent: int, own_fd, peer_fds) -> None:
    """Entry point of the spawned process; `own_fd` (or None) and `peer_fds` are the shared pools' tickets
    (memfd descriptors or CUDA IPC handles: `shared_pool.open_shared`)."""
    _die_with_parent(parent)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s worker-{spec.name}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # NOTE: the coordinator decides when a worker stops
    try:
        step_runner = _build(spec, own_fd, peer_fds)
    except BaseException as e:                             # noqa: BLE001  (reported, then the process ends)
        conn.send_bytes(wire.encode_error(e))
        return
    conn.send_bytes(wire.encode_message(wire.READY, {"pid": os.getpid()}))
    _serve(conn, step_runner, Fault.from_env(spec.name))


def _serve(conn, step_runner: StepRunner, fault: Fault | None) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if wire.is_stop(data):
            return
        try:
            conn.send_bytes(answer(step_runner, data, fault))
        except (BrokenPipeError, OSError):
            return


def answer(step_runner: StepRunner, frame: bytes, fault: Fault | None = None) -> bytes:
    """The reply to one work frame: its outcome once the step's KV copies have landed, or its error."""
    try:
        work = wire.decode_work(frame)
        if fault is not None:
            fault.on_step()
        outcome = step_runner.run(work)
        for _, handle in outcome.copies:
            handle.wait()
        return wire.encode_outcome(outcome)
    except Exception as e:                          # NOTE: reported in the reply
        return wire.encode_error(e)


def build_step_runner(spec: WorkerSpec, own_fd: SharedFd | None = None) -> StepRunner:
    """The runner a worker builds, over a pool of its own (or the memfd segment `own_fd`), with no peers yet
    (a Ray actor's unit)."""
    return _build(spec, own_fd, ())


def _build(spec: WorkerSpec, own_fd, peer_fds) -> StepRunner:
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(len(spec.cores))
    device = torch.device(spec.device)
    prepare_cpu_kernels(spec.cpu_kernels)               # NOTE: a spawned process starts with the default
    model = load_model(spec.model_config, spec.dtype, device, spec.max_model_len, spec.quantization,
                       max(len(spec.cores), 1))
    pool = None if own_fd is None else open_shared(spec.pool, own_fd)
    runner = ModelRunner(model, spec.pool.num_blocks, spec.pool.layout.block_size, spec.eos_token_ids,
                         kv_pool=pool, state_slots=spec.scheduler.max_num_seqs, window_seqs=spec.window_seqs,
                         **spec.step_sizes)
    warm_up_for_serving(runner, spec.warmup_role, spec.scheduler, spec.max_model_len, spec.thread_counts)
    peers = []
    for peer_spec, peer_fd in zip(spec.peer_pools, peer_fds, strict=True):
        check_pools_agree(spec.pool, peer_spec)
        peer_pool = open_shared(peer_spec, peer_fd)
        peers.append(Peer(select_transfer(device, peer_pool.device, spec.kv_transfer), peer_pool))
    return StepRunner(runner, tuple(peers), tier_copier(open_tiers(spec.tiers), device) if spec.tiers else None,
                      spec.kv_verify)


def _die_with_parent(parent: int) -> None:
    """End this process within PARENT_POLL_S of the coordinator's death, however it dies (even mid-step).

    NOTE: not PR_SET_PDEATHSIG: that fires when the *thread* that spawned us exits, and workers are
    spawned from loader and recovery threads that end long before the coordinator does."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
