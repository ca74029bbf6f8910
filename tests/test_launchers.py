"""Fold jobs in other processes and on a real SLURM: parallel jobs through a tracking server, kill -9 and resume,
preemption and requeue. Real processes, a real MLflow server, a real single-node SLURM; tiny data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.orchestration.launchers import LaunchSession, job_slots
from pipeline.runs.store.cv_runs import CvConfig, run_key
from pipeline.runs.store.private_server import tracking_server
from pipeline.utils.paths import PROJECT_ROOT
from tests.conftest import tiny_overrides
from tests.gated_cv import gate_sitecustomize, rendezvous_sitecustomize
from tests.test_cv import FAST


def cv_parent(client: MlflowClient, experiment_name: str = "pain-cv"):
    experiment = client.get_experiment_by_name(experiment_name)
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
    assert job_slots(1, [], [0, 1], max_threads=1)[0]["OMP_NUM_THREADS"] == "1"  # OMP_NUM_THREADS=1 was set
    with pytest.raises(SystemExit, match="one job per GPU"):
        job_slots(3, ["0", "1"], [0, 1])


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (Linux: SigCgt in /proc/<pid>/status)."""
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_started_with_sigint_ignored_still_stops_on_it(tmp_path: Path) -> None:
    """The driver stops a busy worker with SIGINT (`stop_workers`); a driver started in a script's background passes
    SIGINT on ignored, which Python keeps. The worker takes it back: SIGINT ends it (130) instead of being lost."""
    import socket

    mine, theirs = socket.socketpair()
    worker = subprocess.Popen([sys.executable, "-m", "pipeline", "job-worker", str(theirs.fileno())], cwd=PROJECT_ROOT,
                              pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    theirs.close()
    try:
        deadline = time.monotonic() + 120
        while not _catches(worker.pid, signal.SIGINT):  # its handler in place: it waits for its first job
            assert worker.poll() is None and time.monotonic() < deadline, "the worker never took SIGINT back"
            time.sleep(0.2)
        worker.send_signal(signal.SIGINT)
        assert worker.wait(timeout=60) == 130, worker.stdout.read().decode()[-2000:]
    finally:
        worker.kill()
        worker.wait()
        mine.close()


def test_parallel_runs_two_folds_at_once_through_a_server(tiny_config, tmp_path: Path, capsys,
                                                        monkeypatch) -> None:
    # Each fold job, about to write its first epoch checkpoint, waits there until the other has got as far: both
    # then finish only if they ran at the same time, however long either took to start.
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    site = rendezvous_sitecustomize(tmp_path / "site", [0, 1], arrived)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(PROJECT_ROOT)]))
    cfg = tiny_config(*FAST, "launcher=parallel", "launcher.jobs=2", "trainer.max_epochs=2", "trainer.patience=2",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'parallel.db'}")
    summary = run_cv(cfg)
    assert "cv/video_auroc_mean" in summary
    assert sorted(p.name for p in arrived.iterdir()) == ["fold_0", "fold_1"]  # both jobs met at the rendezvous
    out = capsys.readouterr().out
    assert "MLflow server for the fold jobs: http://127.0.0.1:" in out
    assert "fold 0: running" in out and "fold 1: done" in out
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (parent,) = cv_parent(client)
    children = fold_children(client, parent.info.run_id)
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert all(c.data.tags["painvit.tracking_uri"] == cfg.mlflow.tracking_uri for c in children)  # the store
    assert len({c.data.tags["painvit.pid"] for c in children}) == 2  # two processes ...
    first, second = sorted(children, key=lambda c: c.info.start_time)
    assert second.info.start_time < first.info.end_time  # ... at overlapping times


def cv_command(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "cv", *tiny_overrides(base, *FAST, *extra)]


def gated_cv_command(base: Path, gate: tuple[int, int, str], marker: Path, *extra: str) -> list[str]:
    """The same command, held for good at one epoch checkpoint of one fold (tests/gated_cv.py)."""
    fold, epoch, when = gate
    return [sys.executable, "-m", "tests.gated_cv", str(fold), str(epoch), when, str(marker),
            *tiny_overrides(base, *FAST, *extra)]


def fold_metrics(store: MlflowClient, parent_run_id: str) -> dict[str, dict[str, float]]:
    """Per fold, the finished child run's test metrics, best and last epoch, and the last epoch's train and
    validation metrics: the test metrics alone come from the best epoch, which may lie before an interruption."""
    return {c.data.tags["fold"]: {k: v for k, v in c.data.metrics.items()
                                  if k.startswith(("test/", "train/", "val/", "lr/"))
                                  or k in ("best_epoch", "epochs_trained")}
            for c in fold_children(store, parent_run_id) if c.info.status == "FINISHED"}


# Three epochs whatever the validation score does, so a fold killed after epoch 1 has an epoch left to train.
KILL_9 = ("trainer.folds=[0,1]", "trainer.deterministic=true", "trainer.max_epochs=3", "trainer.patience=3")
RUN_ENV = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}


@pytest.fixture(scope="module")
def uninterrupted_folds(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The per-fold results of the kill tests' command run straight through, with no loader workers."""
    db = tmp_path_factory.mktemp("whole") / "whole.db"
    whole = subprocess.run(cv_command(tiny_base, *KILL_9, "loader.num_workers=0", f"mlflow.tracking_uri=sqlite:///{db}",
                                      f"cv.work_dir={db.parent / 'runs'}"),
                           cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    store = MlflowClient(f"sqlite:///{db}")
    (parent,) = cv_parent(store)
    return fold_metrics(store, parent.info.run_id)


def run_until_held(command: list[str], marker: Path) -> subprocess.Popen:
    """Start the gated driver and return it once it holds at its gate (its marker file exists)."""
    driver = subprocess.Popen(command, cwd=PROJECT_ROOT, env=RUN_ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # a bound for a broken run, not a guess at the moment
    while not marker.exists():
        if driver.poll() is not None:
            pytest.fail(f"the driver ended ({driver.returncode}) before its gate: {driver.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            driver.kill()
            pytest.fail("the driver never reached its gate")
        time.sleep(0.2)
    return driver


def kill_9(driver: subprocess.Popen) -> None:
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    driver.stderr.close()


def test_kill_9_at_two_points_then_resume_gives_the_uninterrupted_results(tiny_base: Path, tmp_path: Path,
                                                                          uninterrupted_folds: dict) -> None:
    """SIGKILL at two defined points of fold 1, each time rerunning the same command: (1) in its first epoch, before
    any epoch checkpoint of it exists, so it starts again from nothing; (2) once its epoch-1 checkpoint is on disk,
    so it continues from there. Every fold then has the per-fold test metrics of the run that was never interrupted
    (deterministic algorithms, same seed). The killed runs load with two worker processes, the reference with none:
    the resumed folds match it only if the workers' augmentation streams resume exactly too (the harder case; a run
    without workers takes the same resume path minus the workers)."""
    workers = 2
    db = tmp_path / "killed.db"
    extra = (*KILL_9, f"loader.num_workers={workers}", f"mlflow.tracking_uri=sqlite:///{db}",
             f"cv.work_dir={tmp_path / 'runs'}")
    client = MlflowClient(f"sqlite:///{db}")

    first = run_until_held(gated_cv_command(tiny_base, (1, 0, "before"), tmp_path / "held_1", *extra),
                           tmp_path / "held_1")
    (fold_dir,) = (tmp_path / "runs").glob("*/*/fold_1")
    assert not (fold_dir / "last.ckpt").exists()
    kill_9(first)
    (parent,) = cv_parent(client)
    assert parent.info.status == "RUNNING"  # nobody could mark it
    assert sorted(c.info.status for c in fold_children(client, parent.info.run_id)) == ["FINISHED", "RUNNING"]

    second = run_until_held(gated_cv_command(tiny_base, (1, 1, "after"), tmp_path / "held_2", *extra),
                            tmp_path / "held_2")
    checkpoint = torch.load(fold_dir / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["epoch"] == 1
    kill_9(second)

    rerun = subprocess.run(cv_command(tiny_base, *extra), cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True,
                           text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming: 1 fold(s) already done" in rerun.stdout
    assert [p.info.run_id for p in cv_parent(client)] == [parent.info.run_id]  # the same parent, resumed
    children = fold_children(client, parent.info.run_id)
    # fold 1: one attempt killed in epoch 0, one killed after epoch 1, one resumed from that epoch's checkpoint
    assert sorted(c.info.status for c in children if c.data.tags["fold"] == "1") == ["FINISHED", "KILLED", "KILLED"]
    (resumed,) = [c for c in children if c.data.tags["fold"] == "1" and c.info.status == "FINISHED"]
    assert resumed.data.tags["painvit.resumed_after_epoch"] == "1"
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    assert fold_metrics(client, parent.info.run_id) == uninterrupted_folds


def test_a_parallel_worker_trains_fold_after_fold_and_a_killed_one_resumes_exactly(tiny_base: Path, tmp_path: Path,
                                                                                   uninterrupted_folds: dict) -> None:
    """LAUNCHER=parallel JOBS=1: one worker process trains fold 0, then fold 1 (the same pid on both runs: its imports
    paid once), and is killed with SIGKILL once fold 1's epoch-1 checkpoint is on disk. The driver reports fold 1
    failed with the worker's end and exits non-zero; the same command again takes the dead attempt over at once (its
    process is gone on this machine), continues fold 1 from that checkpoint in a new worker, and every fold ends
    with the per-fold metrics of the run never interrupted."""
    held = tmp_path / "held"
    site = gate_sitecustomize(tmp_path / "site", 1, 1, "after", held)
    env = {**RUN_ENV, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)])}
    db = tmp_path / "pool.db"
    extra = (*KILL_9, "loader.num_workers=0", f"mlflow.tracking_uri=sqlite:///{db}", f"cv.work_dir={tmp_path / 'runs'}",
             "launcher=parallel", "launcher.jobs=1")
    driver = subprocess.Popen(cv_command(tiny_base, *extra), cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600  # a bound for a broken run, not a guess at the moment
    while not held.exists():
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.2)
    client = MlflowClient(f"sqlite:///{db}")
    (parent,) = cv_parent(client)
    first = {c.data.tags["fold"]: c for c in fold_children(client, parent.info.run_id)}
    assert first["0"].info.status == "FINISHED" and first["1"].info.status == "RUNNING"
    worker = int(first["1"].data.tags["painvit.pid"])
    assert first["0"].data.tags["painvit.pid"] == str(worker) != str(driver.pid)  # one worker, fold after fold
    os.kill(worker, signal.SIGKILL)
    out = driver.communicate(timeout=600)[0]
    assert driver.returncode != 0 and f"its worker (pid {worker}) exited with code -9" in out, out[-3000:]

    rerun = subprocess.run(cv_command(tiny_base, *extra), cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True,
                           text=True)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    runs = fold_children(client, parent.info.run_id)
    assert sorted((c.data.tags["fold"], c.info.status) for c in runs) == [
        ("0", "FINISHED"), ("1", "FINISHED"), ("1", "KILLED")]
    (resumed,) = [c for c in runs if c.data.tags["fold"] == "1" and c.info.status == "FINISHED"]
    assert resumed.data.tags["painvit.resumed_after_epoch"] == "1" and resumed.data.tags["painvit.pid"] != str(worker)
    assert fold_metrics(client, parent.info.run_id) == uninterrupted_folds


@pytest.fixture
def slurm_server(slurm_cluster, tmp_path: Path, monkeypatch):
    """A real SLURM and an MLflow server the 'nodes' reach, as `make server` would run on a login node, the driver
    with its admin's credentials (the array tasks get a user made for the run instead)."""
    with tracking_server(f"sqlite:///{tmp_path / 'slurm.db'}", (tmp_path / "artifacts").as_uri()) as server:
        for variable, value in server.admin_credentials.items():
            monkeypatch.setenv(variable, value)
        yield slurm_cluster, server.uri


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
    """A fold preempted once its epoch-1 checkpoint is on disk is requeued, continues from that checkpoint and ends
    with the test metrics of the same fold run straight through on the same cluster (submitted beside it, in an
    experiment of its own so that it is a cross-validation of its own)."""
    cluster, uri = slurm_server
    fold = (*FAST, *SLURM, "trainer.folds=[0]", "trainer.max_epochs=4", "trainer.patience=4",
            "trainer.deterministic=true", f"mlflow.tracking_uri={uri}")
    reference = (*fold, "mlflow.experiment=straight-through")
    assert run_cv(tiny_config(*reference, "launcher.wait=false")) == {}
    assert run_cv(tiny_config(*fold, "launcher.wait=false")) == {}  # submitted, not waited for
    assert "queued on SLURM" in capsys.readouterr().out
    client = MlflowClient(uri)
    (parent,) = cv_parent(client)
    job_id = next(iter(json.loads(parent.data.tags["painvit.slurm_jobs"]).values()))
    fold_cfg = tiny_config(*fold)
    key = run_key(CvConfig.from_config(fold_cfg), uri)
    checkpoint = Path(fold_cfg.cv.work_dir) / key / parent.info.run_id / "fold_0" / "last.ckpt"

    # Wait for the event itself: epoch 1's checkpoint on disk (written atomically, so a file that exists is whole).
    # Then hold the job's python where it is (SIGSTOP) and preempt it there: it is continued only once the
    # preemption signals are pending, so it cannot train on to the end in between.
    deadline = time.monotonic() + 600  # a bound for a broken run, not a guess at the moment
    while not (checkpoint.is_file() and torch.load(checkpoint, map_location="cpu", weights_only=False)["epoch"] >= 1):
        assert time.monotonic() < deadline, "the fold never wrote its epoch-1 checkpoint\n" + cluster.logs()
        time.sleep(0.2)
    (attempt,) = fold_children(client, parent.info.run_id)
    pid = int(attempt.data.tags["painvit.pid"])
    os.kill(pid, signal.SIGSTOP)
    held_at = torch.load(checkpoint, map_location="cpu", weights_only=False)["epoch"]
    assert 1 <= held_at < 3 and client.get_run(attempt.info.run_id).info.status == "RUNNING"
    cluster.preempt(job_id, sigterm_first=True, stopped_pid=pid)

    # the same command, now waiting: it follows the requeued job (no second submission) and aggregates
    run_cv(tiny_config(*fold))
    assert "submitted" not in capsys.readouterr().out
    runs = fold_children(client, parent.info.run_id)
    by_status = {r.info.status: r for r in runs}
    assert sorted(by_status) == ["FINISHED", "KILLED"]
    resumed = by_status["FINISHED"]
    assert int(resumed.data.tags["painvit.resumed_after_epoch"]) == held_at
    assert resumed.data.tags["painvit.slurm_job_id"] == job_id
    # its curves run from epoch 0: the epochs before the preemption come from the checkpoint
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "train/loss")]
    assert steps == list(range(len(steps))) and len(steps) == int(resumed.data.metrics["epochs_trained"])

    run_cv(tiny_config(*reference))  # follows the straight-through fold to its end
    (straight,) = cv_parent(client, "straight-through")
    assert fold_metrics(client, parent.info.run_id) == fold_metrics(client, straight.info.run_id)


TWO_STAGE = ("trainer.folds=[0]", "trainer.deterministic=true", "trainer.max_epochs=2", "trainer.patience=2",
             "model.head.name=gru", "loader.clip_frames=3", "model.head.hidden=16", "model.head.epochs=5",
             "model.head.patience=2")


def test_a_two_stage_fold_killed_in_its_second_stage_resumes_with_the_uninterrupted_results(tiny_base: Path,
                                                                                          tmp_path: Path) -> None:
    """SIGKILL once the fold's frame model has embedded its videos and its temporal head is about to train; the same
    command again reads the embeddings back from the fold's cache entry (checked against its key) instead of
    embedding again, and the fold ends with the test metrics of the same command run straight through."""
    def command(db: Path, *gate: str) -> list[str]:
        extra = (*TWO_STAGE, f"mlflow.tracking_uri=sqlite:///{db}", f"cv.work_dir={db.parent / 'runs'}")
        if gate:
            return gated_cv_command(tiny_base, (0, 0, "second_stage"), Path(gate[0]), *extra)
        return cv_command(tiny_base, *extra)

    (tmp_path / "whole").mkdir()
    whole = subprocess.run(command(tmp_path / "whole" / "m.db"), cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True,
                           text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    (tmp_path / "killed").mkdir()
    db = tmp_path / "killed" / "m.db"
    kill_9(run_until_held(command(db, str(tmp_path / "held")), tmp_path / "held"))
    (fold_dir,) = (db.parent / "runs").glob("*/*/fold_0")
    assert list((fold_dir / "embeddings").glob("*.json")) and (fold_dir / "last.ckpt").is_file()

    rerun = subprocess.run(command(db), cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    killed, whole_store = MlflowClient(f"sqlite:///{db}"), MlflowClient(f"sqlite:///{tmp_path / 'whole' / 'm.db'}")
    (parent,), (straight,) = cv_parent(killed), cv_parent(whole_store)
    children = fold_children(killed, parent.info.run_id)
    assert sorted(c.info.status for c in children) == ["FINISHED", "KILLED"]
    (finished,) = [c for c in children if c.info.status == "FINISHED"]
    (reference,) = fold_children(whole_store, straight.info.run_id)
    records = [json.loads(Path(store.download_artifacts(run.info.run_id, "two_stage.json",
                                                         str(tmp_path / name))).read_text())
               for store, run, name in ((killed, finished, "resumed"), (whole_store, reference, "whole"))]
    assert [r["embeddings_read_back"] for r in records] == [True, False]  # read back, not embedded again
    assert fold_metrics(killed, parent.info.run_id) == fold_metrics(whole_store, straight.info.run_id)


def test_the_cvs_of_one_command_share_one_server_and_one_worker(tiny_config, tmp_path: Path, capsys) -> None:
    """`make table` and `make power` run CVs one after the other in a `LaunchSession`: the second CV's fold goes to
    the worker the first one started (the same pid: its imports paid once), through the same private server."""
    common = (*FAST, "launcher=parallel", "launcher.jobs=1", "trainer.folds=[0]", "trainer.max_epochs=1",
              f"mlflow.tracking_uri=sqlite:///{tmp_path / 'session.db'}")
    with LaunchSession() as session:
        for task in ("bl1_vs_pa1", "bl1_vs_pa4"):
            assert "cv/video_auroc_mean" in run_cv(tiny_config(*common, f"task={task}"), session)
    out = capsys.readouterr().out
    assert out.count("MLflow server for the fold jobs: http://127.0.0.1:") == 1
    client = MlflowClient(f"sqlite:///{tmp_path / 'session.db'}")
    parents = cv_parent(client)
    assert sorted(p.data.tags["task"] for p in parents) == ["bl1_vs_pa1", "bl1_vs_pa4"]
    children = [c for p in parents for c in fold_children(client, p.info.run_id)]
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert len({c.data.tags["painvit.pid"] for c in children}) == 1  # one worker for both CVs
