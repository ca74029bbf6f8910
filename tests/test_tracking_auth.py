"""`make server` asks who you are: a real MLflow basic-auth server on loopback (SERVER_AUTH=on; a non-loopback host
turns it on by itself), the refusals of unsafe settings, and a tiny cross-validation through it with MLflow's own
credential variables, whose password appears in no file of the store, its artifacts, the CV's work folder or the
server's log."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.runs.cross_validation import run_cv
from pipeline.runs.launchers import stop_process_group
from pipeline.runs.tracking_server import PASSWORD_ENV, USERNAME_ENV, tracking_access_problem
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT
from tests.conftest import tiny_overrides
from tests.test_cv import FAST
from tests.test_launchers import cv_parent, fold_children

MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed", "server"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_settings(own: Path, port: int) -> list[str]:
    return [f"SERVER_PORT={port}", f"SERVER_STORE=sqlite:///{own / 'mlflow.db'}", f"SERVER_ARTIFACTS={own / 'art'}",
            f"SERVER_AUTH_DB=sqlite:///{own / 'auth.db'}", f"SERVER_AUTH_CONFIG={own / 'auth.ini'}", "SERVER_WORKERS=1"]


def status_of(url: str, user: str = "", password: str = "") -> int:
    headers = {}
    if user:
        import base64

        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    own = tmp_path_factory.mktemp("auth_server")
    password = secrets.token_urlsafe(18)
    secret = own / "admin password"
    secret.write_text(password + "\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_AUTH", "MLFLOW_TRACKING"))}
    env["PYTHONPATH"] = str(PROJECT_ROOT)

    secret.chmod(0o644)  # readable by others: refused before anything starts
    refused = subprocess.run([*MAKE, *server_settings(own, port), "SERVER_AUTH=on",
                              f"SERVER_ADMIN_PASSWORD_FILE={secret}"], cwd=PROJECT_ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "readable by you only (chmod 600" in refused.stderr, refused.stderr
    secret.chmod(0o600)

    log = (own / "server.log").open("w")
    process = subprocess.Popen([*MAKE, *server_settings(own, port), "SERVER_AUTH=on",
                                f"SERVER_ADMIN_PASSWORD_FILE={secret}"], cwd=PROJECT_ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not (_answers(port) and status_of(f"{uri}/health") == 200):
            assert process.poll() is None, (own / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the tracking server did not answer /health within 180 s"
            time.sleep(0.5)
        yield {"uri": uri, "password": password, "own": own, "env": env, "port": port}
    finally:
        stop_process_group(process)
        log.close()


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_unsafe_server_settings_are_refused(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_AUTH", "MLFLOW_TRACKING"))}
    env["PYTHONPATH"] = str(PROJECT_ROOT)
    port = free_port()
    # open on every interface: refused unless SERVER_INSECURE=1; authenticated without an admin password: refused
    for extra, expected in ((["SERVER_HOST=0.0.0.0", "SERVER_AUTH=off"], "SERVER_INSECURE=1"),
                            (["SERVER_HOST=0.0.0.0"], "MLFLOW_AUTH_ADMIN_PASSWORD")):
        done = subprocess.run([*MAKE, *server_settings(tmp_path, port), *extra], cwd=PROJECT_ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and expected in done.stderr, done.stderr
        assert not _answers(port)


def test_the_server_refuses_strangers_and_a_cv_with_credentials_works(auth_server, tiny_base, tmp_path,
                                                                      monkeypatch) -> None:
    uri, password = auth_server["uri"], auth_server["password"]
    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=1"
    assert status_of(search) == 401  # no credentials: refused
    assert status_of(search, "admin", "wrong") == 401
    assert status_of(search, "admin", password) == 200
    # what LAUNCHER=slurm asks before submitting: credentials needed, none in the URI
    assert USERNAME_ENV in tracking_access_problem(uri, {})
    assert tracking_access_problem(uri, {USERNAME_ENV: "admin", PASSWORD_ENV: password}) is None
    assert "carries credentials" in tracking_access_problem(f"http://admin:{password}@127.0.0.1:1", {})

    # a tiny CV (one fold, one epoch) with MLflow's own variables: the driver here, the fold in a fold-job process
    # of its own (the parallel launcher: a job file, and the credentials only in the environment it inherits); parent
    # and fold runs, metrics and artifacts through the server's artifact proxy. Without the fold model: every request
    # checks the password hash (scrypt, tens of ms), and the model's artifacts double the requests and the time
    monkeypatch.setenv(USERNAME_ENV, "admin")
    monkeypatch.setenv(PASSWORD_ENV, password)
    settings = [o for o in FAST if not o.startswith(("trainer.folds", "trainer.max_epochs"))]
    cfg = load_config(tiny_overrides(tiny_base, *settings, "trainer.folds=[0]", "trainer.max_epochs=1",
                                     f"mlflow.tracking_uri={uri}", f"cv.work_dir={tmp_path / 'runs'}",
                                     f"reports_dir={tmp_path / 'reports'}", "cv.log_models=false",
                                     "launcher=parallel", "launcher.jobs=1"))
    summary = run_cv(cfg)
    assert "cv/video_auroc_mean" in summary
    client = MlflowClient(uri)
    (parent,) = cv_parent(client)
    (child,) = fold_children(client, parent.info.run_id)
    assert parent.info.status == child.info.status == "FINISHED"
    assert child.data.tags["painvit.pid"] != str(os.getpid())  # trained by the fold-job process
    assert list((tmp_path / "runs").rglob("fold_0.json"))  # its job file, searched for the password below
    assert "test/video_auroc" in child.data.metrics
    assert client.list_artifacts(parent.info.run_id)  # artifacts went through the proxy
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(MlflowException):  # the same client without the password: refused
        MlflowClient(uri).get_run(parent.info.run_id)
    # the password is in no file of the store, the artifacts, the auth settings, the server's log or the CV's
    # work folder (fold job files, checkpoints)
    for path in [*auth_server["own"].rglob("*"), *(tmp_path / "runs").rglob("*")]:
        if path.is_file() and path.name != "admin password":
            assert password.encode() not in path.read_bytes(), path
