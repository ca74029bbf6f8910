"""A tracking server on PostgreSQL, as a lab runs it: a real PostgreSQL cluster (tests/postgres_cluster.py), `make
server` over two of its databases (the runs and the auth users) with the password in a .pgpass file, a CV with
parallel fold jobs and a SLURM CV through it, and `make ui` reading the store straight from the database with the
password in PGPASSWORD. The password is in no command line, log, tag, parameter or file the runs write."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store.private_server import free_port
from pipeline.runs.store.tracking_server import PASSWORD_ENV, USERNAME_ENV, auth_call
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group
from tests.conftest import tiny_overrides
from tests.make_server import MakeServer, status_of
from tests.test_cv import FAST
from tests.test_launchers import SLURM, cv_parent, fold_children

# two folds, one epoch: a CV in seconds
TWO_FOLDS = ("trainer.folds=[0,1]", "trainer.max_epochs=1", "trainer.patience=1", "cv.log_models=false")


@pytest.fixture(scope="module")
def pg_server(postgres_cluster, tmp_path_factory):
    """`make server` over two databases of the cluster, libpq's password file given in PGPASSFILE (as ~/.pgpass)."""
    own = tmp_path_factory.mktemp("pg_server")
    pgpass = own / "pgpass"
    pgpass.write_text(postgres_cluster.pgpass_line())
    pgpass.chmod(0o600)
    store = postgres_cluster.new_database()
    server = MakeServer(own, {"SERVER_STORE": store, "SERVER_AUTH_DB": postgres_cluster.new_database("auth")},
                        {"PGPASSFILE": str(pgpass)})
    try:
        yield server.start(), store
    finally:
        server.stop()


def cv_config(base: Path, own: Path, uri: str, *extra: str):
    return load_config(tiny_overrides(base, *FAST, *TWO_FOLDS, f"mlflow.tracking_uri={uri}",
                                      f"cv.work_dir={own / 'runs'}", f"reports_dir={own / 'reports'}", *extra))


def secrets_in_runs(client: MlflowClient, secret: str) -> list[str]:
    """Every tag and parameter of every run of every experiment that holds `secret`."""
    found = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id], max_results=1000):
            for kind, values in (("tag", run.data.tags), ("param", run.data.params)):
                found += [f"{run.info.run_id} {kind} {key}" for key, value in values.items() if secret in value]
    return found


@pytest.mark.slow
def test_a_parallel_cv_through_make_server_on_postgresql_and_no_password_anywhere(pg_server, postgres_cluster,
                                                                                  tiny_base, tmp_path,
                                                                                  monkeypatch) -> None:
    server, store = pg_server
    assert status_of(f"{server.uri}/api/2.0/mlflow/experiments/search?max_results=1") == 401  # asks who you are
    for variable, value in zip((USERNAME_ENV, PASSWORD_ENV), server.admin, strict=True):
        monkeypatch.setenv(variable, value)
    summary = run_cv(cv_config(tiny_base, tmp_path, server.uri, "launcher=parallel", "launcher.jobs=2"))
    assert "cv/video_auroc_mean" in summary
    client = MlflowClient(server.uri)
    (parent,) = cv_parent(client)
    children = fold_children(client, parent.info.run_id)
    assert parent.info.status == "FINISHED" and sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert len({c.data.tags["painvit.pid"] for c in children} | {str(os.getpid())}) == 3  # two fold-job processes
    # in PostgreSQL itself, not in a file beside the server
    database = store.rsplit("/", 1)[1]
    assert postgres_cluster.sql(f"SELECT status FROM runs WHERE run_uuid = '{parent.info.run_id}'",
                                database) == "FINISHED\n"
    assert not list(server.folder.glob("*.db"))

    password = postgres_cluster.password  # the database's: in the .pgpass file only
    assert not secrets_in_runs(client, password)
    command_lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in server.group()]  # what ps shows
    assert any(b"mlflow" in line and b"server" in line for line in command_lines)
    assert not [line for line in command_lines if password.encode() in line or store.encode() in line]
    for path in [*server.folder.rglob("*"), *tmp_path.rglob("*")]:  # logs, auth settings, artifacts, job files
        if path.is_file() and path.name != "pgpass":
            assert password.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_a_slurm_cv_through_make_server_on_postgresql(slurm_cluster, pg_server, tiny_base, tmp_path,
                                                      monkeypatch) -> None:
    server, _ = pg_server
    for variable, value in zip((USERNAME_ENV, PASSWORD_ENV), server.admin, strict=True):
        monkeypatch.setenv(variable, value)
    cfg = cv_config(tiny_base, tmp_path, server.uri, *SLURM, "mlflow.experiment=slurm-on-postgresql")
    assert "cv/video_auroc_mean" in run_cv(cfg)
    client = MlflowClient(server.uri)
    (parent,) = cv_parent(client, "slurm-on-postgresql")
    children = fold_children(client, parent.info.run_id)
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    assert all(c.info.status == "FINISHED" and "_" in c.data.tags["painvit.slurm_job_id"] for c in children)


@pytest.mark.slow
def test_make_ui_reads_the_postgresql_store_with_the_password_from_the_environment(postgres_cluster,
                                                                                   tmp_path) -> None:
    """`make ui` with MLFLOW_TRACKING_URI on the database (no password in it) and the password in PGPASSWORD: the
    UI's private server opens the store (its environment keeps the database password, nothing else secret), and
    a run written there directly (no server: what a CV does with this URI) is what it serves. No training is needed
    for that: the CVs above train through the server on the same kind of store. Stopped with SIGTERM, it removes
    the password's folder as on Ctrl+C."""
    store = postgres_cluster.new_database()
    os.environ["PGPASSWORD"] = postgres_cluster.password  # for the client below, which writes the store directly
    try:
        client = MlflowClient(store)
        written = client.create_run(client.create_experiment("ui-reads", (tmp_path / "art").as_uri()))
        client.log_metric(written.info.run_id, "test/video_auroc", 0.75)
        client.set_terminated(written.info.run_id, "FINISHED")
    finally:
        del os.environ["PGPASSWORD"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_AUTH", "MLFLOW_TRACKING"))}
    env.update({"MLFLOW_TRACKING_URI": store, "PGPASSWORD": postgres_cluster.password,
                "PYTHONPATH": str(PROJECT_ROOT)})
    out = tmp_path / "ui.out"
    with out.open("w") as log:
        ui = subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "ui", f"MLFLOW_PORT={port}"],
                              cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "password in" not in out.read_text():
            assert ui.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        printed = out.read_text()
        assert f"over {store}:" in printed and postgres_cluster.password not in printed
        secret = Path(re.search(r"password in (\S+) \(", printed).group(1))
        password = secret.read_text().strip()
        status, runs = auth_call(f"http://127.0.0.1:{port}", "/api/2.0/mlflow/runs/get", "admin", password,
                                 query={"run_id": written.info.run_id})
        assert status == 200 and runs["run"]["info"]["status"] == "FINISHED"
        assert runs["run"]["data"]["metrics"] == [{**runs["run"]["data"]["metrics"][0], "key": "test/video_auroc",
                                                   "value": 0.75}]
        os.killpg(ui.pid, signal.SIGTERM)  # `kill`, not Ctrl+C (test_tracking's): it cleans up all the same
        assert ui.wait(timeout=180) in (0, 2, 143, -signal.SIGTERM), out.read_text()[-2000:]
        removed_by = time.monotonic() + 60  # make waits for its child on SIGTERM; the folder goes in its cleanup
        while secret.parent.exists():
            assert time.monotonic() < removed_by, f"{secret.parent} is still there after SIGTERM"
            time.sleep(0.2)
    finally:
        stop_process_group(ui, grace_s=10)
