"""Child processes that end with the process that started them: dying with the parent (Linux), and a process
group stopped with SIGTERM, then SIGKILL; and a process that hears the signals it is stopped with, whatever it
inherited."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def die_with_parent() -> None:
    """In a child process (Linux): receive SIGTERM when the launching process dies, even by kill -9."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def interrupt_on(*signals: signal.Signals) -> None:
    """The first of `signals` to arrive raises KeyboardInterrupt in the main thread, so that the `finally` blocks
    run; any that follows is ignored, so that it cannot cut that cleanup short (make passes a SIGTERM on to its
    child, which the process group already got). A process started in the background of a script inherits SIGINT
    ignored (POSIX; Python then installs no handler of its own), so a command that says "stop with Ctrl+C", or a
    worker its driver stops with SIGINT, sets it here rather than trust what it inherited; SIGTERM (`kill`) would
    otherwise end it without its cleanup. SIGKILL still ends it at once."""

    def interrupt(signum: int, frame: object) -> None:
        for each in signals:
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in signals:
        signal.signal(signum, interrupt)


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
