"""A tracking server that goes away mid-CV: `make server` (over sqlite, and over a real PostgreSQL) killed with
SIGKILL while a fold job trains and a fold has finished, then started again: nothing is lost, no fold is trained
twice, and the CV ends with the results of an undisturbed run. A server that stays away stops the fold job and the
driver after the bounded retries, each with one line, instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.runs.store.tracking_server import PASSWORD_ENV, USERNAME_ENV
from pipeline.runs.store.unreachable import EXIT_UNREACHABLE
from pipeline.utils.paths import PROJECT_ROOT
from tests.conftest import tiny_overrides
from tests.gated_cv import gate_sitecustomize
from tests.make_server import MakeServer
from tests.test_cv import FAST
from tests.test_launchers import RUN_ENV, cv_parent, fold_children, fold_metrics

# two folds of one epoch, the same numbers on every run of them (fold 1 is held at its epoch's checkpoint: its test,
# records and artifacts then meet the dead server)
TWO_FOLDS = ("trainer.folds=[0,1]", "trainer.max_epochs=1", "trainer.patience=1", "trainer.deterministic=true",
             "cv.log_models=false")


def command(base: Path, own: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "cv", *tiny_overrides(base, *FAST, *TWO_FOLDS,
                                                                    f"cv.work_dir={own / 'runs'}",
                                                                    f"reports_dir={own / 'reports'}", *extra)]


@pytest.fixture(scope="module")
def undisturbed(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fold metrics of the same CV run straight through, in a store of its own: on the same launcher (two
    workers of one thread each: a fold's sums in another number of threads would round otherwise)."""
    own = tmp_path_factory.mktemp("undisturbed")
    done = subprocess.run(command(tiny_base, own, f"mlflow.tracking_uri=sqlite:///{own / 'm.db'}", "launcher=parallel",
                                  "launcher.jobs=2"), cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    store = MlflowClient(f"sqlite:///{own / 'm.db'}")
    (parent,) = cv_parent(store)
    return fold_metrics(store, parent.info.run_id)


def held_driver(base: Path, own: Path, server: MakeServer, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`pipeline cv` through `server` with two fold jobs at once (LAUNCHER=parallel JOBS=2), fold 1's job held at its
    first epoch checkpoint until `<own>/gate/release` exists (tests/gated_cv.py, in the job processes only)."""
    gate = own / "gate"
    gate.mkdir()
    site = gate_sitecustomize(own / "site", 1, 0, "until", gate)
    env = {**RUN_ENV, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)]),
           USERNAME_ENV: server.admin[0], PASSWORD_ENV: server.admin[1]}
    log = own / "driver.log"
    with log.open("w") as out:
        driver = subprocess.Popen(command(base, own, f"mlflow.tracking_uri={server.uri}", "launcher=parallel",
                                          "launcher.jobs=2", *extra), cwd=PROJECT_ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    return driver, log


def wait_for(what: str, ready, driver: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s  # a bound for a broken run, not a guess at the moment
    while not ready():
        assert driver.poll() is None, f"the driver ended before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"never: {what}\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def fold_log(own: Path, fold: int) -> str:
    return "".join(path.read_text(errors="replace") for path in (own / "runs").rglob(f"fold_{fold}.log"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_server_killed_mid_cv_and_started_again_loses_no_fold(kind: str, request, tiny_base: Path, tmp_path: Path,
                                                                undisturbed: dict) -> None:
    """Fold 0 finished and fold 1 held at its epoch checkpoint when the server is killed (SIGKILL); fold 1 then goes on
    and its tracking calls find no server (its log says that they retry); the server starts again on the same port
    over the same store, and the driver finishes: one run per fold (fold 0's the one finished before the kill), every
    fold FINISHED, the fold metrics of the undisturbed run."""
    (tmp_path / "server").mkdir()
    if kind == "sqlite":
        store, extra = f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}", {}
    else:
        cluster = request.getfixturevalue("postgres_cluster")
        store, extra = cluster.new_database(), {"PGPASSWORD": cluster.password}
    server = MakeServer(tmp_path / "server", {"SERVER_STORE": store,
                                              "SERVER_AUTH_DB": f"sqlite:///{tmp_path / 'server' / 'auth.db'}"},
                        extra).start()
    driver, log = held_driver(tiny_base, tmp_path, server)
    try:
        os.environ[USERNAME_ENV], os.environ[PASSWORD_ENV] = server.admin
        client = MlflowClient(server.uri)

        def fold_0_finished_and_fold_1_held() -> bool:
            if not list((tmp_path / "gate").glob("arrived_*")) or not cv_parent(client):
                return False
            (parent,) = cv_parent(client)
            return any(c.data.tags["fold"] == "0" and c.info.status == "FINISHED"
                       for c in fold_children(client, parent.info.run_id))

        wait_for("fold 0 finished while fold 1 is held", fold_0_finished_and_fold_1_held, driver, log)
        (parent,) = cv_parent(client)
        (finished_before,) = [c.info.run_id for c in fold_children(client, parent.info.run_id)
                              if c.data.tags["fold"] == "0"]
        server.kill()
        (tmp_path / "gate" / "release").write_text("go\n")
        wait_for("fold 1's tracking calls retrying", lambda: "Retrying" in fold_log(tmp_path, 1), driver, log)
        server.start()
        assert driver.wait(timeout=600) == 0, log.read_text()[-3000:]
        children = fold_children(client, parent.info.run_id)
        metrics = fold_metrics(client, parent.info.run_id)
    finally:
        for variable in (USERNAME_ENV, PASSWORD_ENV):
            os.environ.pop(variable, None)
        if driver.poll() is None:
            driver.kill()
        server.stop()
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]  # one attempt each: none trained twice
    assert all(c.info.status == "FINISHED" for c in children)
    assert [c.info.run_id for c in children if c.data.tags["fold"] == "0"] == [finished_before]
    assert metrics == undisturbed


@pytest.mark.slow
def test_a_server_that_stays_away_stops_the_job_and_the_driver_with_one_line(tiny_base: Path, tmp_path: Path) -> None:
    """mlflow.retry_s=5: the server killed while fold 1 is held and never started again. The fold job gives up after
    its bounded retries and says so in one line; the driver stops launching, says so in one line and exits 75 (try
    again later), well within a minute of the release: no hang."""
    (tmp_path / "server").mkdir()
    server = MakeServer(tmp_path / "server", {"SERVER_STORE": f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}",
                                              "SERVER_AUTH_DB": f"sqlite:///{tmp_path / 'server' / 'auth.db'}"}).start()
    driver, log = held_driver(tiny_base, tmp_path, server, "mlflow.retry_s=5", "trainer.folds=[1]")
    try:
        wait_for("fold 1 held", lambda: bool(list((tmp_path / "gate").glob("arrived_*"))), driver, log)
        server.kill()
        (tmp_path / "gate" / "release").write_text("go\n")
        released = time.monotonic()
        code = driver.wait(timeout=300)
        stopped_after = time.monotonic() - released
    finally:
        if driver.poll() is None:
            driver.kill()
        server.stop()
    out = log.read_text()
    assert code == EXIT_UNREACHABLE, out[-3000:]
    said = f"the tracking server {server.uri} did not answer for about 6 s (mlflow.retry_s); stopped. What " \
           f"finished is kept: once the server answers again, the same command resumes"
    assert out.strip().splitlines()[-1] == f"make cv: {said}", out[-3000:]
    assert fold_log(tmp_path, 1).strip().splitlines()[-1] == f"fold 1: {said}"
    assert "Traceback" not in out and "Traceback" not in fold_log(tmp_path, 1)
    assert stopped_after < 60, stopped_after
