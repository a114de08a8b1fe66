"""OpenMP worker threads given back: by a thread itself, and by an idle unit whose cores a neighbour borrows."""
import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from pdserve.engine.worker.compute import ThreadCompute, share_cores
from pdserve.engine.worker.openmp import release_thread_pool

BIG = torch.ones(1 << 20)          # large enough for torch to split an element-wise op across threads


def native_threads() -> int:
    """Threads of this process that Python did not start (OpenMP workers among them)."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def parallel_op(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.add(BIG, 1.0)


@pytest.fixture
def thread():
    with ThreadPoolExecutor(1) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result()


@pytest.fixture(autouse=True)
def started_openmp(thread):
    """The first parallel region of a process also starts threads that stay (the runtime's own)."""
    thread(parallel_op, 2)
    thread(release_thread_pool)


def test_a_thread_gives_back_its_openmp_workers(thread):
    before = native_threads()
    thread(parallel_op, 2)
    assert native_threads() == before + 1
    assert thread(release_thread_pool)
    assert native_threads() == before
    thread(parallel_op, 2)                      # the next parallel region starts a pool again
    assert native_threads() == before + 1


@dataclass
class Work:
    threads: int | None


class Runner:
    device, num_blocks, block_size, eos_token_ids, state_slots = torch.device("cpu"), 1, 16, frozenset(), None
    kv_window, window_slots = 0, None


class ParallelStep:
    """A stand-in step runner: each step is one element-wise op on the step's thread count."""

    runner, reads_back_later = Runner(), False

    def run(self, work: Work) -> int:
        parallel_op(work.threads or 1)
        return torch.get_num_threads()


def test_an_idle_unit_gives_back_its_workers_when_a_neighbour_steps_on_its_cores():
    cores = tuple(sorted(os.sched_getaffinity(0)))
    lender, borrower = ThreadCompute(ParallelStep(), "lender", cores), ThreadCompute(ParallelStep(), "borrower", cores)
    elsewhere = ThreadCompute(ParallelStep(), "elsewhere", ())            # no cores named: not a neighbour
    share_cores([lender, borrower, elsewhere])
    assert lender.core_neighbours == (borrower,) and not elsewhere.core_neighbours

    async def scenario():
        before = native_threads()
        await lender.submit(Work(2))
        assert native_threads() == before + 1
        await borrower.submit(Work(2))           # the lender idles: its pool goes, the borrower's comes
        lender.call(lambda: None)                # the release ran (the lender's thread runs in order)
        assert native_threads() == before + 1
        await borrower.submit(Work(2))           # nothing left to give back
        assert native_threads() == before + 1

    try:
        asyncio.run(scenario())
    finally:
        for unit in (lender, borrower, elsewhere):
            unit.close()
