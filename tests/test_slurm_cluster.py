"""SLURM code paths against a real single-node SLURM (tests/slurm_cluster.py): arrays, submitit, preempt + requeue."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit

from tests.slurm_cluster import SlurmCluster

# The jobs unpickle these functions in a fresh python whose working directory need not be the repository root.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_sbatch_array_runs_every_task(slurm_cluster: SlurmCluster, tmp_path: Path):
    script = tmp_path / "task.sh"
    script.write_text(f'#!/bin/bash\necho "$SLURM_ARRAY_TASK_ID" > {tmp_path}/task_"$SLURM_ARRAY_TASK_ID".txt\n')
    job_id = slurm_cluster.sbatch(
        "--array=0-2", "--cpus-per-task=1", "--mem=200M", f"--output={tmp_path}/%A_%a.out", str(script)
    )
    states = slurm_cluster.wait_finished(job_id, timeout=30)
    assert states == {f"{job_id}_{i}": "COMPLETED" for i in range(3)}
    assert {p.name: p.read_text().strip() for p in tmp_path.glob("task_*.txt")} == {
        f"task_{i}.txt": str(i) for i in range(3)
    }


def square_in_slurm(x: int) -> tuple[int, str, str]:
    return x * x, os.environ["SLURM_ARRAY_TASK_ID"], sys.executable


def slurm_executor(folder: Path) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    # submitit counts a USR2 after min(80 % of the limit, limit - 10 min) of run time as a time-out (each uses up one
    # of max_num_timeout=3 requeues), an earlier one as a preemption: with 60 min (threshold 48 min) the tests'
    # signal is a preemption; with 10 min or less every signal is a time-out.
    executor.update_parameters(timeout_min=60, cpus_per_task=1, mem_gb=0.5, slurm_partition="debug")
    return executor


def test_submitit_map_array(slurm_cluster: SlurmCluster, tmp_path: Path):
    jobs = slurm_executor(tmp_path).map_array(square_in_slurm, [3, 4])
    slurm_cluster.wait_for_submitit(jobs, timeout=30)
    assert [job.result() for job in jobs] == [(9, "0", sys.executable), (16, "1", sys.executable)]


class EpochTrainer:
    """Stands in for a fold's training job: one 'epoch' per step, the epochs done kept on the instance, which
    submitit pickles at checkpoint() and unpickles in the requeued job (the Checkpointable pattern)."""

    def __init__(self, folder: Path, epochs: int):
        self.folder, self.epochs = folder, epochs
        self.done: list[tuple[int, str]] = []  # (epoch, SLURM_RESTART_COUNT of the attempt that ran it)

    def __call__(self, name: str, preempt_after: int | None) -> list[tuple[int, str]]:
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        while len(self.done) < self.epochs:
            self.done.append((len(self.done), attempt))
            if attempt == "0" and len(self.done) == preempt_after:
                (self.folder / f"{name}_ready_for_preemption").touch()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # the signal handler runs between these sleeps
                    time.sleep(0.1)
                raise RuntimeError("never preempted")
        return self.done

    def checkpoint(self, name: str, preempt_after: int | None) -> submitit.helpers.DelayedSubmission:
        (self.folder / f"{name}_checkpointed_after_{len(self.done)}").touch()
        return submitit.helpers.DelayedSubmission(self, name, preempt_after)


@pytest.mark.parametrize(
    "array, sigterm_first", [(False, False), (True, False), (False, True)], ids=["job", "array_task", "sigterm_first"]
)
def test_preempted_submitit_job_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path, array: bool, sigterm_first: bool
):
    executor, trainer = slurm_executor(tmp_path), EpochTrainer(tmp_path, epochs=4)
    if array:  # like one job per fold: only the second task is preempted
        jobs = executor.map_array(trainer, ["fold0", "fold1"], [None, 2])
    else:
        jobs = [executor.submit(trainer, "fold1", 2)]
    # Signal only once the first attempt's function runs (submitit's handlers installed) and has done its epochs.
    ready = tmp_path / "fold1_ready_for_preemption"
    deadline = time.monotonic() + 120  # a bound for a broken run, not a guess at the moment
    while not ready.exists():
        assert time.monotonic() < deadline, f"first attempt never started:\n{jobs[-1].stderr()}"
        time.sleep(0.2)
    slurm_cluster.preempt(jobs[-1].job_id, sigterm_first=sigterm_first, log=jobs[-1].paths.stderr)
    # The requeued attempt's end as SLURM sees it, before submitit's: the requeue sends SIGTERM to every process of
    # the first attempt's step, and when that reaches submitit's `scontrol requeue` before it exited, submitit
    # pickles the CalledProcessError as the job's result (done() turns true) until the requeued attempt overwrites it.
    assert slurm_cluster.wait_finished(jobs[-1].job_id, timeout=120) == {jobs[-1].job_id: "COMPLETED"}
    slurm_cluster.wait_for_submitit(jobs, timeout=120)
    assert jobs[-1].result() == [(0, "0"), (1, "0"), (2, "1"), (3, "1")]
    assert (tmp_path / "fold1_checkpointed_after_2").exists()
    if array:
        assert jobs[0].result() == [(i, "0") for i in range(4)]


@pytest.fixture
def short_dir():
    """A cluster's own folder under /tmp with a short name: slurmd's socket paths must fit in 108 bytes, and a test's
    tmp_path (longer under make test's workers, popen-gw0/...) can make its spool path too long."""
    folder = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_clusters_start_and_stop_one_after_another(slurm_cluster: SlurmCluster, tmp_path: Path, short_dir: Path):
    """Fresh ports and folders each time, SLURM_CONF restored, daemons gone, the session's cluster unharmed."""
    before = os.environ["SLURM_CONF"]
    seen_ports = {slurm_cluster.ports}
    for i in range(2):
        with SlurmCluster(short_dir / f"c{i}") as cluster:
            assert os.environ["SLURM_CONF"] == str(cluster.conf)
            assert cluster.ports not in seen_ports
            seen_ports.add(cluster.ports)
            job_id = cluster.sbatch(f"--output={tmp_path}/c{i}.out", "--wrap=echo ran")
            assert cluster.wait_finished(job_id) == {job_id: "COMPLETED"}
        assert os.environ["SLURM_CONF"] == before
        assert cluster.daemons_alive() == {"slurmctld": False, "slurmd": False}
    job_id = slurm_cluster.sbatch(f"--output={tmp_path}/session.out", "--wrap=echo ran")
    assert slurm_cluster.wait_finished(job_id) == {job_id: "COMPLETED"}


class BrokenCluster(SlurmCluster):
    def write_config(self) -> None:
        super().write_config()
        with self.conf.open("a") as conf:
            conf.write("NoSuchSetting=1\n")


def test_a_cluster_that_cannot_start_fails_loudly(short_dir: Path):
    before = os.environ.get("SLURM_CONF")
    with pytest.raises(RuntimeError, match="start slurmctld") as error:
        with BrokenCluster(short_dir):
            pass
    assert "NoSuchSetting" in str(error.value)
    assert os.environ.get("SLURM_CONF") == before
