"""Processes this project starts (fold jobs, search workers, private tracking servers): a free port for a server, a
child that dies with its parent, the tail of a process's log, and stopping a process with everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """In a child process (Linux): receive SIGTERM when the launching process dies, even by kill -9."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a process's log ("" where it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_process_group(process: subprocess.Popen, grace_s: float = 30) -> None:
    """End a process started in its own session (`start_new_session=True`) and everything it started: SIGTERM to
    the group, SIGKILL after `grace_s` seconds; gone already is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
