"""Fold jobs in other processes and on a real SLURM: parallel jobs through a tracking server, kill -9 and resume,
preemption and requeue. Real processes, a real MLflow server, a real single-node SLURM; tiny data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline import PROJECT_ROOT
from pipeline.cv import run_cv
from pipeline.launchers import job_slots, tracking_server
from tests.conftest import tiny_overrides
from tests.test_cv import FAST


def cv_parent(client: MlflowClient):
    experiment = client.get_experiment_by_name("pain-cv")
    return client.search_runs([experiment.experiment_id], "tags.`painvit.run_kind` = 'cv'")


def fold_children(client: MlflowClient, parent_run_id: str) -> list:
    parent = client.get_run(parent_run_id)
    return client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


def test_job_slots_give_each_job_its_gpu_or_its_share_of_the_cores() -> None:
    assert job_slots(None, ["0", "1", "2"], [0, 1]) == [
        {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2"}]
    cpu = job_slots(2, [], [0, 1, 2, 3])
    assert [slot["PAINVIT_CPUS"] for slot in cpu] == ["0,1", "2,3"]
    assert all(slot["OMP_NUM_THREADS"] == "2" and slot["CUDA_VISIBLE_DEVICES"] == "" for slot in cpu)
    assert len(job_slots(None, [], [0, 1])) == 1  # no GPU: one job unless told otherwise
    with pytest.raises(SystemExit, match="one job per GPU"):
        job_slots(3, ["0", "1"], [0, 1])


def test_parallel_runs_two_folds_at_once_through_a_server(tiny_config, tmp_path: Path, capsys) -> None:
    # 4 epochs: long enough that the two folds overlap even when one job's interpreter starts seconds after the other
    cfg = tiny_config(*FAST, "launcher=parallel", "launcher.jobs=2", "trainer.max_epochs=4", "trainer.patience=4",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'parallel.db'}")
    summary = run_cv(cfg)
    assert "cv/video_auroc_mean" in summary
    out = capsys.readouterr().out
    assert "MLflow server for the fold jobs: http://127.0.0.1:" in out
    assert "fold 0: running" in out and "fold 1: done" in out
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (parent,) = cv_parent(client)
    children = fold_children(client, parent.info.run_id)
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert all(c.data.tags["painvit.tracking_uri"].startswith("http://127.0.0.1:") for c in children)
    assert len({c.data.tags["painvit.pid"] for c in children}) == 2  # two processes ...
    first, second = sorted(children, key=lambda c: c.info.start_time)
    assert second.info.start_time < first.info.end_time  # ... at overlapping times


def cv_command(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "cv", *tiny_overrides(base, *FAST, *extra)]


def test_kill_9_then_resume_gives_the_uninterrupted_results(tiny_base: Path, tmp_path: Path) -> None:
    """The driver is killed with SIGKILL after its first fold finished, in the middle of the second; the same command
    then completes the run with one finished child per fold and the same per-fold test metrics as a run that was
    never interrupted (deterministic algorithms, same seed)."""
    folds = ("trainer.folds=[0,1,2]", "trainer.deterministic=true", "trainer.max_epochs=2",
             f"cv.work_dir={tmp_path / 'runs'}")
    killed_db = f"mlflow.tracking_uri=sqlite:///{tmp_path / 'killed.db'}"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    driver = subprocess.Popen(cv_command(tiny_base, *folds, killed_db), cwd=PROJECT_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = MlflowClient(f"sqlite:///{tmp_path / 'killed.db'}")
    deadline = time.time() + 300
    while True:
        assert driver.poll() is None, "the driver ended before it could be killed"
        assert time.time() < deadline, "no fold finished within 5 minutes"
        # a fold folder exists once the driver has set up the store: only then may a second process open it
        parents = cv_parent(client) if list((tmp_path / "runs").glob("*/fold_*")) else []
        if parents and any(c.info.status == "FINISHED" for c in fold_children(client, parents[0].info.run_id)):
            break
        time.sleep(0.5)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    parent_id = parents[0].info.run_id
    assert client.get_run(parent_id).info.status == "RUNNING"  # nobody could mark it

    rerun = subprocess.run(cv_command(tiny_base, *folds, killed_db), cwd=PROJECT_ROOT, env=env, capture_output=True,
                           text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming: 1 fold(s) already done" in rerun.stdout
    assert [p.info.run_id for p in cv_parent(client)] == [parent_id]  # the same parent, resumed
    children = fold_children(client, parent_id)
    finished = sorted(c.data.tags["fold"] for c in children if c.info.status == "FINISHED")
    assert finished == ["0", "1", "2"]  # exactly one finished run per fold
    assert all(c.info.status in ("FINISHED", "KILLED") for c in children)  # the interrupted attempt: KILLED
    assert client.get_run(parent_id).info.status == "FINISHED"

    whole_db = tmp_path / "whole.db"
    whole = subprocess.run(cv_command(tiny_base, *folds, f"mlflow.tracking_uri=sqlite:///{whole_db}"),
                           cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uninterrupted = MlflowClient(f"sqlite:///{whole_db}")
    (whole_parent,) = cv_parent(uninterrupted)

    def test_metrics(store: MlflowClient, run_id: str) -> dict:
        return {c.data.tags["fold"]: {k: v for k, v in c.data.metrics.items() if k.startswith("test/")}
                for c in fold_children(store, run_id) if c.info.status == "FINISHED"}

    assert test_metrics(client, parent_id) == test_metrics(uninterrupted, whole_parent.info.run_id)


@pytest.fixture
def slurm_server(slurm_cluster, tmp_path: Path):
    """A real SLURM and an MLflow server the 'nodes' reach, as `make server` would run on a login node."""
    with tracking_server(f"sqlite:///{tmp_path / 'slurm.db'}", (tmp_path / "artifacts").as_uri()) as uri:
        yield slurm_cluster, uri


SLURM = ("launcher=slurm", "launcher.cpus_per_task=1", "launcher.mem_gb=1", "launcher.time_min=60",
         "launcher.poll_s=1", "loader.num_workers=0")


def test_slurm_runs_each_fold_as_an_array_task(slurm_server, tiny_config, capsys) -> None:
    cluster, uri = slurm_server
    cfg = tiny_config(*FAST, *SLURM, "trainer.max_epochs=1", f"mlflow.tracking_uri={uri}")
    summary = run_cv(cfg)
    assert "cv/video_auroc_mean" in summary
    out = capsys.readouterr().out
    assert "submitted 2 fold job(s) to SLURM" in out and "[2/2 folds done]" in out
    client = MlflowClient(uri)
    (parent,) = cv_parent(client)
    children = fold_children(client, parent.info.run_id)
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" and "_" in c.data.tags["painvit.slurm_job_id"] for c in children)
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"


def test_a_preempted_fold_is_requeued_and_continues_from_its_epoch_checkpoint(slurm_server, tiny_config,
                                                                             capsys) -> None:
    cluster, uri = slurm_server
    cfg = tiny_config(*FAST, *SLURM, "trainer.folds=[0]", "trainer.max_epochs=40", "trainer.patience=40",
                      f"mlflow.tracking_uri={uri}", "launcher.wait=false")
    assert run_cv(cfg) == {}  # submitted, not waited for
    assert "queued on SLURM" in capsys.readouterr().out
    client = MlflowClient(uri)
    (parent,) = cv_parent(client)
    job_id = next(iter(__import__("json").loads(parent.data.tags["painvit.slurm_jobs"]).values()))
    deadline = time.time() + 180
    # Preempt once epoch 1's checkpoint surely exists: an epoch's loss is logged just before its checkpoint is
    # written, so the third logged epoch means the second one's checkpoint is on disk.
    while True:
        assert time.time() < deadline, "the fold never reached its third epoch\n" + cluster.logs()
        runs = fold_children(client, parent.info.run_id)
        if runs and len(client.get_metric_history(runs[0].info.run_id, "train/loss")) >= 3:
            break
        time.sleep(0.5)
    cluster.preempt(job_id, sigterm_first=True)

    # the same command, now waiting: it follows the requeued job (no second submission) and aggregates
    run_cv(tiny_config(*FAST, *SLURM, "trainer.folds=[0]", "trainer.max_epochs=40", "trainer.patience=40",
                       f"mlflow.tracking_uri={uri}"))
    assert "submitted" not in capsys.readouterr().out
    runs = fold_children(client, parent.info.run_id)
    by_status = {r.info.status: r for r in runs}
    assert sorted(by_status) == ["FINISHED", "KILLED"]
    resumed = by_status["FINISHED"]
    assert int(resumed.data.tags["painvit.resumed_after_epoch"]) >= 1
    assert resumed.data.tags["painvit.slurm_job_id"] == job_id
    # its curves run from epoch 0: the epochs before the preemption come from the checkpoint
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "train/loss")]
    assert steps == list(range(len(steps))) and len(steps) == int(resumed.data.metrics["epochs_trained"])
