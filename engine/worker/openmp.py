"""Giving back a thread's OpenMP worker threads.

libgomp (torch's OpenMP runtime, and the native kernels') keeps one pool of worker threads per thread that
ever ran a parallel region on more than one thread. While the workers of all pools together are fewer than
the cores it spin-waits between parallel regions; past that it wakes them through the kernel for every
region, and a step is hundreds of small regions, so one idle pool left on another thread slows every
multi-threaded step (bench/RESULTS.md, "OpenMP pools"). So the idle partner of a unit that borrows its cores
gives its pool back (`release_thread_pool`, called by `ThreadCompute.release_idle_pool`), in each libgomp
copy loaded (wheels bundle their own).
"""
from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


@functools.cache
def _pause_functions() -> tuple:
    """`omp_pause_resource_all` (OpenMP 5.0, GCC 9+) of every libgomp copy loaded in this process (torch's, and
    the copies wheels such as sentencepiece bundle: each keeps its own pools); empty without one."""
    found = []
    for path in _loaded_libgomps():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            logger.debug("%s has no omp_pause_resource_all: its OpenMP pools are kept", path)
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        found.append(pause)
    return tuple(found)


def _loaded_libgomps() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libgomp" in line and ".so" in line})
    except OSError:
        return []


def release_thread_pool() -> bool:
    """Join the calling thread's OpenMP worker threads, in every libgomp copy (its next parallel region starts a
    fresh pool). False where no OpenMP runtime can (not libgomp, or one older than GCC 9): nothing is done."""
    results = [pause(OMP_PAUSE_SOFT) for pause in _pause_functions()]
    return bool(results) and all(result == 0 for result in results)


def on_single_threaded_loader(fn, *args):
    """Run `fn(*args)` on a short-lived thread limited to one intra-op thread: a thread that ran multi-threaded
    CPU ops keeps its OpenMP team alive, and one left behind by loading slows every CPU step after."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,)) as loader:
        return loader.submit(fn, *args).result()
