"""Worker processes for the OpenCV-heavy stages (synthetic video writing, face cropping), and how many to start."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from multiprocessing.pool import Pool
from typing import Any


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (Linux), else the machine's count.

    The mask is what a container, `taskset` or a SLURM allocation grants; os.cpu_count() counts the whole machine.
    macOS and Windows have no sched_getaffinity, so there the machine's count is the answer. Never below 1.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def process_pool(workers: int, initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> Pool:
    """A pool whose workers start from a clean process (forkserver, or spawn where there is none).

    Not fork: forking a parent whose OpenCV thread pool has already run can deadlock the children.
    """
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers, initializer=initializer, initargs=initargs)


@contextlib.contextmanager
def one_torch_thread(when: bool = True) -> Iterator[None]:
    """One torch thread inside the block (when `when`): training a head on embeddings is thousands of tiny ops, where
    a second thread only waits for the first, and on a busy CPU each op waits for a descheduled thread (a frozen
    probe's fold took 45 s on two threads, 7 s on one, on a 2-core machine with another process running)."""
    import torch

    threads = torch.get_num_threads()
    if when:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
