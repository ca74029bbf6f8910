"""Step timing: the wall time of each step of a fold (setup, fit, test, artifacts, ...), for `train` and
`train_fold` (`pipeline.runs.jobs.fold_job`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StepTimes:
    """Wall time of each step of a fold (`with times("fit"): ...`), logged as `time/<step>_s` and printed once:
    what a fold costs besides training."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        return {f"time/{step}_s": round(seconds, 3) for step, seconds in self.seconds.items()}

    def line(self) -> str:
        return ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.seconds.items())
