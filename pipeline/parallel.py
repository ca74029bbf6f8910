"""Worker processes for the OpenCV-heavy stages (synthetic video writing, face cropping)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.pool import Pool
from typing import Any


def process_pool(workers: int, initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> Pool:
    """A pool whose workers start from a clean process (forkserver, or spawn where there is none).

    Not fork: forking a parent whose OpenCV thread pool has already run can deadlock the children.
    """
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers, initializer=initializer, initargs=initargs)
