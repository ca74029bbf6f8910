"""One fold trained once across machines: the lease in a real MLflow store (sqlite, as a tracking server keeps it),
claimed by racing threads, waited for while its heartbeat lives, taken over once it stops."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
from mlflow import MlflowClient

from pipeline.runs.store import fold_lease
from pipeline.runs.store.tracking import (
    FOLD_RUN,
    FOLD_TAG,
    HOST_TAG,
    PARENT_TAG,
    PID_TAG,
    RUN_KIND_TAG,
    SLURM_JOB_TAG,
    fold_runs,
)


@pytest.fixture(scope="module")
def lease_store(tmp_path_factory) -> tuple[str, str]:
    """One sqlite store for the module (creating one costs a second or two); each test has a parent run of its own."""
    own = tmp_path_factory.mktemp("lease")
    uri = f"sqlite:///{own / 'lease.db'}"
    return uri, MlflowClient(uri).create_experiment("lease", artifact_location=str(own / "art"))


def store(lease_store: tuple[str, str]) -> tuple[str, str, str]:
    uri, experiment = lease_store
    parent = MlflowClient(uri).create_run(experiment, tags={RUN_KIND_TAG: "cv"})
    return uri, experiment, parent.info.run_id


def fold_run(client: MlflowClient, experiment: str, parent: str, fold: int, tags: dict[str, str]):
    return client.create_run(experiment, tags={PARENT_TAG: parent, RUN_KIND_TAG: FOLD_RUN, FOLD_TAG: str(fold),
                                               **tags})


def test_racing_claims_give_each_attempt_to_one_owner(lease_store) -> None:
    uri, _, parent = store(lease_store)
    won: dict[int, list[str]] = {fold: [] for fold in range(4)}
    start = threading.Barrier(3)

    def contender(owner: str) -> None:
        client = MlflowClient(uri)  # one client (and connection pool) per contender, as on separate machines
        start.wait()
        for fold in won:
            if fold_lease.claim(client, parent, fold, None, 1, owner, lease_s=60) == 1:
                won[fold].append(owner)

    threads = [threading.Thread(target=contender, args=(f"node{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(len(owners) == 1 for owners in won.values()), won
    params = MlflowClient(uri).get_run(parent).data.params
    for fold, owners in won.items():
        assert params[fold_lease.claim_key(fold, None, 1)].split()[0] == owners[0]


def test_a_live_lease_is_waited_for_and_a_dead_one_taken_over(lease_store) -> None:
    uri, experiment, parent = store(lease_store)
    client = MlflowClient(uri)
    # fold 0: trained elsewhere right now (another host, a fresh heartbeat); the second job waits, then reuses it
    other = fold_run(client, experiment, parent, 0, {**fold_lease.lease_tags("login2:77:abcd"), HOST_TAG: "login2"})
    answer: dict = {}
    waiter = threading.Thread(target=lambda: answer.update(result=fold_lease.acquire(
        MlflowClient(uri), parent, 0, None, "login1:1:ef01", 60, lambda: fold_runs(client, parent, 0), poll_s=0.2)))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive()  # still waiting: the fold is not trained twice
    client.set_terminated(other.info.run_id, "FINISHED")
    waiter.join(timeout=30)
    attempt, finished = answer["result"]
    assert attempt == 0 and finished.info.run_id == other.info.run_id

    # fold 1: its node went silent: taken over once this observer has seen its heartbeat unchanged for lease_s of
    # its own clock (not at once: how old the value looks says nothing, the other node's clock may be skewed)
    silent = fold_run(client, experiment, parent, 1, {**fold_lease.lease_tags("login2:78:abcd"), HOST_TAG: "login2"})
    client.set_tag(silent.info.run_id, fold_lease.HEARTBEAT_TAG, f"{time.time() - 600:.3f}")
    started = time.monotonic()
    attempt, finished = fold_lease.acquire(client, parent, 1, None, "login1:1:ef01", 2,
                                           lambda: fold_runs(client, parent, 1), poll_s=0.2)
    assert attempt == 2 and finished is None and time.monotonic() - started >= 2
    assert client.get_run(silent.info.run_id).info.status == "KILLED"

    # fold 2: a job of this machine (host, boot, PID namespace) whose process is gone, heartbeat still fresh: no
    # wait for the lease to run out
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fold_run(client, experiment, parent, 2, {**fold_lease.lease_tags("me:1:0"), HOST_TAG: fold_lease.machine_identity(),
                                             PID_TAG: str(gone.pid)})
    started = time.monotonic()
    attempt, _ = fold_lease.acquire(client, parent, 2, None, "login1:1:ef01", 60, lambda: fold_runs(client, parent, 2))
    assert attempt == 2 and time.monotonic() - started < 5


def test_a_skewed_clock_does_not_make_a_live_lease_stale(lease_store) -> None:
    """The other node's clock runs three hours behind: its heartbeat values look three hours old, but they change.
    The observer waits for four lease periods without taking the fold; once the renewals stop, it takes it over."""
    uri, experiment, parent = store(lease_store)
    client = MlflowClient(uri)
    lease_s = 1.5
    other = fold_run(client, experiment, parent, 0, {**fold_lease.lease_tags("login2:79:abcd"), HOST_TAG: "login2"})
    stop = threading.Event()

    def renew() -> None:  # the other node's heartbeat thread, by its own (skewed) clock
        renewer = MlflowClient(uri)
        while not stop.wait(lease_s / 5):
            renewer.set_tag(other.info.run_id, fold_lease.HEARTBEAT_TAG, f"{time.time() - 3 * 3600:.3f}")

    renewing = threading.Thread(target=renew)
    renewing.start()
    answer: dict = {}
    waiter = threading.Thread(target=lambda: answer.update(result=fold_lease.acquire(
        MlflowClient(uri), parent, 0, None, "login1:1:ef01", lease_s, lambda: fold_runs(client, parent, 0),
        poll_s=0.1)))
    waiter.start()
    try:
        time.sleep(4 * lease_s)
        assert waiter.is_alive(), answer  # still waiting: a live lease, whatever its clock says
        assert client.get_run(other.info.run_id).info.status == "RUNNING"
    finally:
        stop.set()
        renewing.join(timeout=30)
    waiter.join(timeout=60)
    assert answer["result"] == (2, None)
    assert client.get_run(other.info.run_id).info.status == "KILLED"


def test_time_the_store_was_away_does_not_count_against_a_heartbeat() -> None:
    """An observer's sightings of an unchanged heartbeat count only while they come at most lease_s / 2 apart: a
    server that was away longer than the lease (its owner could not beat either) starts the count again, and a
    heartbeat that stays unchanged across regular sightings is still found dead after lease_s."""
    now = [0.0]
    watch = fold_lease.Watch(10, clock=lambda: now[0])
    for moment, counted in ((0, 0), (4, 4), (8, 8), (40, 0), (44, 4), (48, 8), (52, 12)):
        now[0] = moment
        assert watch.unchanged_s("run", "1700000000.000") == counted, moment
    assert watch.abandoned("claim", "owner 1") is False
    now[0] = 100  # 48 s later, not seen in between: counted from here
    assert watch.abandoned("claim", "owner 1") is False
    now[0] = 104
    assert watch.unchanged_s("claim", "owner 1") == 4


def test_a_process_number_is_judged_only_on_this_very_machine(lease_store) -> None:
    """A fresh attempt whose process number is not running here is dead at once only when its host tag is this
    machine's: host name, boot id and PID namespace. The same host name in another PID namespace (a second container)
    or another boot, or an older run's plain host name, is another machine: its heartbeat is watched instead."""
    uri, experiment, parent = store(lease_store)
    client = MlflowClient(uri)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    own = fold_lease.machine_identity()
    host, boot, namespace = own.split(" ")
    assert host == socket.gethostname() and fold_lease.UNKNOWN not in own  # Linux: boot id and namespace read
    for fold, tag in enumerate((f"{host} {boot} pidns=1", f"{host} boot=another-boot {namespace}", host)):
        run = fold_run(client, experiment, parent, fold, {**fold_lease.lease_tags("twin:1:0"), HOST_TAG: tag,
                                                          PID_TAG: str(gone.pid)})
        assert fold_lease.Watch(60).is_live(client.get_run(run.info.run_id)), tag
    here = fold_run(client, experiment, parent, 3, {**fold_lease.lease_tags("me:1:0"), HOST_TAG: own,
                                                    PID_TAG: str(gone.pid)})
    assert not fold_lease.Watch(60).is_live(client.get_run(here.info.run_id))


def test_a_requeued_slurm_task_takes_over_its_own_attempt_at_once(lease_store, monkeypatch) -> None:
    uri, experiment, parent = store(lease_store)
    client = MlflowClient(uri)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    # preempted on another node a moment ago: its heartbeat is fresh, but it is this very task before its requeue
    before = fold_run(client, experiment, parent, 0, {**fold_lease.lease_tags("node7:9:abcd"), HOST_TAG: "node7",
                                                      SLURM_JOB_TAG: "4240_0"})
    started = time.monotonic()
    attempt, _ = fold_lease.acquire(client, parent, 0, None, "node3:1:ef01", 60, lambda: fold_runs(client, parent, 0))
    assert attempt == 2 and time.monotonic() - started < 5
    assert client.get_run(before.info.run_id).info.status == "KILLED"


def test_two_parents_created_at_once_become_one(lease_store) -> None:
    uri, experiment, _ = store(lease_store)
    client = MlflowClient(uri)
    identity = {RUN_KIND_TAG: "cv", "model": "m", "config_sha256": "abc"}
    killed_long_ago = client.create_run(experiment, start_time=int(time.time() * 1000) - 3_600_000, tags=identity)
    other = client.create_run(experiment, tags={**identity, "config_sha256": "other"})
    first = client.create_run(experiment, tags=identity)
    second = client.create_run(experiment, tags=identity)
    # each driver asks once its own parent is written; both go on with the same one, the other is deleted
    assert fold_lease.first_of_twins(client, experiment, identity, second).info.run_id == first.info.run_id
    assert fold_lease.first_of_twins(client, experiment, identity, first).info.run_id == first.info.run_id
    assert client.get_run(second.info.run_id).info.lifecycle_stage == "deleted"
    for kept in (killed_long_ago, other, first):  # an old killed CV and another CV are no twins
        assert client.get_run(kept.info.run_id).info.lifecycle_stage == "active"


def test_two_make_cv_at_once_through_one_server_train_every_fold_once(tiny_base, tmp_path, monkeypatch) -> None:
    """Two drivers of the same CV (`pipeline cv`, as `make cv` runs it), started together through one tracking
    server, each with its own work and lock folder (two machines). Whichever claims fold 0 is held inside it until
    the other has said that it waits for that fold: the fold leases, not luck, keep them apart. Both finish, with
    one parent between them, and every fold is trained by exactly one of them."""
    from pipeline.runs.store.private_server import tracking_server
    from pipeline.utils.paths import PROJECT_ROOT
    from tests.conftest import tiny_overrides
    from tests.test_cv import FAST
    from tests.test_launchers import RUN_ENV, cv_parent, fold_children

    gate = tmp_path / "gate"
    gate.mkdir()
    settings = [o for o in FAST if not o.startswith(("trainer.folds", "trainer.max_epochs", "trainer.patience"))]
    with tracking_server(f"sqlite:///{tmp_path / 'shared.db'}", str(tmp_path / "shared_artifacts")) as server:
        uri = server.uri
        for variable, value in server.admin_credentials.items():  # the drivers' and this client's user
            monkeypatch.setenv(variable, value)
        drivers = {}
        for name in ("a", "b"):
            command = [sys.executable, "-m", "tests.gated_cv", "0", "0", "until", str(gate),
                       *tiny_overrides(tiny_base, *settings, "trainer.folds=[0,1]", "trainer.max_epochs=1",
                                       "trainer.patience=1", f"mlflow.tracking_uri={uri}",
                                       f"cv.work_dir={tmp_path / name / 'runs'}",
                                       f"reports_dir={tmp_path / name / 'reports'}", "cv.lease_s=20")]
            log = (tmp_path / f"{name}.log").open("w")
            drivers[name] = (subprocess.Popen(command, cwd=PROJECT_ROOT, env={**RUN_ENV,
                                              **server.admin_credentials}, stdout=log,
                                              stderr=subprocess.STDOUT, text=True), log)
        try:
            deadline = time.monotonic() + 600  # a bound for a broken run, not a guess at how long they take
            # one driver holds fold 0 (its gate), the other says it waits for it
            while not (list(gate.glob("arrived_*")) and any(
                    "fold 0 is being trained by" in (tmp_path / f"{n}.log").read_text() for n in drivers)):
                for name, (process, _) in drivers.items():
                    assert process.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the drivers never met at fold 0"
                time.sleep(0.2)
            (gate / "release").write_text("go\n")
            for name, (process, log) in drivers.items():
                assert process.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
                log.close()
        finally:
            for process, log in drivers.values():
                if process.poll() is None:
                    process.kill()
                log.close()
        client = MlflowClient(uri)
        (parent,) = cv_parent(client)  # the twin parent made at the same moment was folded into this one
        children = fold_children(client, parent.info.run_id)
    assert parent.info.status == "FINISHED"
    assert sorted(c.data.tags[FOLD_TAG] for c in children) == ["0", "1"]  # one run per fold: none trained twice
    assert all(c.info.status == "FINISHED" for c in children)
    (holder,) = gate.glob("arrived_*")  # fold 0 reached its first checkpoint in one driver only ...
    by_fold = {c.data.tags[FOLD_TAG]: c.data.tags[PID_TAG] for c in children}
    assert by_fold["0"] == holder.name.removeprefix("arrived_")  # ... the one its run names
    pids = {str(process.pid) for process, _ in drivers.values()}
    assert set(by_fold.values()) <= pids
    waiter = next(n for n, (process, _) in drivers.items() if str(process.pid) != by_fold["0"])
    assert "fold 0 is being trained by" in (tmp_path / f"{waiter}.log").read_text()


def test_a_job_whose_fold_is_taken_over_stops_and_does_not_finish_its_run(tiny_base, tmp_path) -> None:
    """A real fold job (`pipeline cv`, local launcher) held at its epoch-0 checkpoint; the test takes its fold over as
    another node would (claims attempt 2, marks attempt 1 KILLED, starts attempt 2's run under its own lease). The
    job's heartbeat sees it, and once released the job stops at its next step: attempt 1 ends KILLED with the reason,
    after one epoch of two. The job then waits for the fold like any other; attempt 2 never beats, so the job takes
    it over in turn once its heartbeat has stood still for lease_s, and finishes the fold as attempt 3."""
    from pipeline.utils.paths import PROJECT_ROOT
    from tests.conftest import tiny_overrides
    from tests.test_cv import FAST
    from tests.test_launchers import RUN_ENV, cv_parent, fold_children

    gate = tmp_path / "gate"
    gate.mkdir()
    uri = f"sqlite:///{tmp_path / 'taken.db'}"
    settings = [o for o in FAST if not o.startswith(("trainer.folds", "trainer.max_epochs", "trainer.patience"))]
    command = [sys.executable, "-m", "tests.gated_cv", "0", "0", "until", str(gate),
               *tiny_overrides(tiny_base, *settings, "trainer.folds=[0]", "trainer.max_epochs=2",
                               "trainer.patience=2", f"mlflow.tracking_uri={uri}", f"cv.work_dir={tmp_path / 'runs'}",
                               f"reports_dir={tmp_path / 'reports'}", "cv.lease_s=4", "cv.log_models=false")]
    log_path = tmp_path / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen(command, cwd=PROJECT_ROOT, env=RUN_ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # a bound for a broken run, not a guess at how long it takes
        while not list(gate.glob("arrived_*")):
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the fold never reached its epoch-0 checkpoint"
            time.sleep(0.2)
        client = MlflowClient(uri)
        (parent,) = cv_parent(client)
        (first,) = fold_children(client, parent.info.run_id)
        assert first.info.status == "RUNNING"
        # taken over from elsewhere, as fold_lease.acquire does it: the claim, the old attempt KILLED, a new run
        other = "node9:4242:abcd"
        assert fold_lease.claim(client, parent.info.run_id, 0, None, 2, other, lease_s=4) == 2
        client.set_terminated(first.info.run_id, "KILLED")
        second = fold_run(client, parent.info.experiment_id, parent.info.run_id, 0,
                          {**fold_lease.lease_tags(other), HOST_TAG: "node9 boot=b pidns=1", PID_TAG: "4242",
                           "painvit.attempt": "2"})
        deadline = time.monotonic() + 120  # its heartbeat beats every lease_s / 5 = 0.8 s
        while "lease lost" not in log_path.read_text():
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the job's heartbeat never saw its fold taken over"
            time.sleep(0.2)
        (gate / "release").write_text("go\n")
        assert driver.wait(timeout=600) == 0, log_path.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    out = log_path.read_text()
    assert "this job stopped without finishing it" in out
    runs = {c.data.tags["painvit.attempt"]: c for c in fold_children(client, parent.info.run_id)}
    assert sorted(runs) == ["1", "2", "3"]
    stopped = runs["1"]
    assert stopped.info.status == "KILLED" and "another job took the fold over" in stopped.data.tags[
        "painvit.lease_lost"]
    assert [m.step for m in client.get_metric_history(stopped.info.run_id, "train/loss")] == [0]  # epoch 1 not run
    assert not any(key.startswith("test/") for key in stopped.data.metrics)  # never tested, never finished
    assert runs["2"].info.run_id == second.info.run_id and runs["2"].info.status == "KILLED"  # it never beat
    assert runs["3"].info.status == "FINISHED" and runs["3"].data.tags["painvit.resumed_after_epoch"] == "0"
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
