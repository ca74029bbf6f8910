"""Freed memory given back to the system by a long-running server (glibc's `malloc_trim`; elsewhere nothing).

A scoring server decodes and scores frames on several threads. glibc keeps what a thread frees in that thread's arena,
and after the first large block is freed it raises its mmap threshold to that block's size, so later frames come from
the arenas too and stay there once freed: a `make serve` process grew by 1.4 GiB over 120 requests of 2000 x 2000
frames and never shrank. `malloc_trim(0)` hands the free pages of every arena back; called after each request it kept
the process within 0.1 GiB of its start on the same requests, for 1-5 % more CPU. Forcing large blocks onto mmap
(`M_MMAP_THRESHOLD`) did as well for memory but cost 50 % more CPU in page faults.

A trim takes from milliseconds to a few hundred on a busy machine, so `Trimmer` runs it on a thread of its own, at
most once every `min_interval_s`, after requests ask for it, rather than in a request's time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from functools import cache


@cache
def libc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def trim_freed_memory() -> bool:
    """Every arena's free pages given back to the system; False where that cannot be done here."""
    trim = libc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class Trimmer:
    """`trim_freed_memory` on a daemon thread of its own, soon after `wanted()` is called, at most once every
    `min_interval_s` seconds."""

    def __init__(self, min_interval_s: float) -> None:
        self.min_interval_s = min_interval_s
        self.asked = threading.Event()
        self.started = False
        self.starting = threading.Lock()

    def wanted(self) -> None:
        """Ask for a trim (a request is done); starts the thread on first use."""
        if libc_trim() is None:
            return
        if not self.started:
            with self.starting:
                if not self.started:
                    threading.Thread(target=self.run, name="memory-trimmer", daemon=True).start()
                    self.started = True
        self.asked.set()

    def run(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            trim_freed_memory()
            time.sleep(self.min_interval_s)
