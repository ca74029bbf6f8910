"""A process that hears the signals it is stopped with: `interrupt_on` (pipeline/utils/processes.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from pipeline.utils.paths import PROJECT_ROOT

CHILD = """
import sys, time
from pipeline.utils.processes import interrupt_on
interrupt_on(signal_numbers.SIGINT, signal_numbers.SIGTERM)
try:
    print("ready", flush=True)  # inside the try: the test's signal may come before print returns
    while True:
        time.sleep(0.1)
except KeyboardInterrupt as interrupted:
    print(f"interrupted by {interrupted}", flush=True)
    time.sleep(1.5)  # the cleanup, during which a second signal arrives
    print("cleaned up", flush=True)
""".replace("signal_numbers", "__import__('signal')")


def test_the_first_signal_interrupts_and_the_next_cannot_cut_the_cleanup_short() -> None:
    """Started with SIGINT ignored (a script's background job), the child still takes Ctrl+C as an interrupt; the
    SIGTERM that make passes on while the child cleans up is ignored, so the cleanup finishes."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "interrupted by SIGINT"
        time.sleep(0.3)
        child.send_signal(signal.SIGTERM)  # during the cleanup
        rest = child.stdout.read()
        assert child.wait(timeout=30) == 0 and rest.strip() == "cleaned up", rest
    finally:
        child.kill()
        child.wait()
