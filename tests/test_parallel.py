"""How many CPUs a stage may use: the affinity mask where the OS has one, the machine's count where it has none."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.data.datamodule import MAX_AUTO_WORKERS, default_num_workers
from pipeline.utils.cpus import available_cpus
from pipeline.utils.paths import PROJECT_ROOT


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="this OS has no affinity mask")
def test_the_affinity_mask_is_what_counts() -> None:
    assert available_cpus() == len(os.sched_getaffinity(0))
    assert default_num_workers() == min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="this OS cannot restrict a process's CPUs")
def test_a_restricted_affinity_mask_is_respected() -> None:
    """As under `taskset -c N` or a one-core SLURM allocation: one CPU allowed, however many the machine has."""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from pipeline.data.datamodule import default_num_workers\n"
        "from pipeline.utils.cpus import available_cpus\n"
        "print(available_cpus(), default_num_workers())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


def test_without_an_affinity_mask_the_machines_count_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS (and Windows) have no os.sched_getaffinity."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert available_cpus() == os.cpu_count()
    assert default_num_workers() == min(os.cpu_count(), MAX_AUTO_WORKERS)


def test_an_unknown_cpu_count_means_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.cpu_count() returns None where the count cannot be determined."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert available_cpus() == 1
