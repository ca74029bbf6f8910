"""`make server` asks who you are, on loopback too: a real MLflow basic-auth server started by `make server` with its
defaults, whose command lines hold neither the store nor a password, the refusals of unsafe settings, and a tiny
cross-validation through it with MLflow's own credential variables (an admin's: the fold job gets a user made for the
run), whose password appears in no file of the store, its artifacts, the CV's work folder or the server's log."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store.tracking_server import (
    JOB_USER_PREFIX,
    PASSWORD_ENV,
    USERNAME_ENV,
    auth_call,
    tracking_access_problem,
)
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group
from tests.conftest import tiny_overrides
from tests.test_cv import FAST
from tests.test_launchers import cv_parent, fold_children

MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed", "server"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_settings(own: Path, port: int) -> list[str]:
    return [f"SERVER_PORT={port}", f"SERVER_ARTIFACTS={own / 'art'}", f"SERVER_AUTH_CONFIG={own / 'auth.ini'}",
            "SERVER_WORKERS=1"]


def store_settings(own: Path) -> dict[str, str]:
    """The store and the auth database, given to `make server` in the environment: on make's command line `ps`
    would show them (with a database password, if the URI held one)."""
    return {"SERVER_STORE": f"sqlite:///{own / 'mlflow.db'}", "SERVER_AUTH_DB": f"sqlite:///{own / 'auth.db'}"}


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
    env.update(store_settings(own))

    secret.chmod(0o644)  # readable by others: refused before anything starts
    refused = subprocess.run([*MAKE, *server_settings(own, port), f"SERVER_ADMIN_PASSWORD_FILE={secret}"],
                             cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "readable by you only (chmod 600" in refused.stderr, refused.stderr
    secret.chmod(0o600)

    log = (own / "server.log").open("w")
    process = subprocess.Popen([*MAKE, *server_settings(own, port), f"SERVER_ADMIN_PASSWORD_FILE={secret}"],
                               cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not (_answers(port) and status_of(f"{uri}/health") == 200):
            assert process.poll() is None, (own / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the tracking server did not answer /health within 180 s"
            time.sleep(0.5)
        yield {"uri": uri, "password": password, "own": own, "env": env, "port": port, "group": process.pid}
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
    # open: refused unless SERVER_INSECURE=1, on every interface and on loopback (which every account reaches);
    # authenticated without an admin password: refused; a store group-readable: refused with its path
    shared = tmp_path / "open.db"
    shared.write_bytes(b"")
    shared.chmod(0o644)
    for extra, store, expected in ((["SERVER_HOST=0.0.0.0", "SERVER_AUTH=off"], {}, "SERVER_INSECURE=1"),
                                   (["SERVER_AUTH=off"], {}, "every account on this machine"),
                                   (["SERVER_HOST=0.0.0.0"], {}, "MLFLOW_AUTH_ADMIN_PASSWORD"),
                                   ([], {}, "MLFLOW_AUTH_ADMIN_PASSWORD"),
                                   ([], {"SERVER_STORE": f"sqlite:///{shared}"}, f"{shared} is -rw-r--r--")):
        done = subprocess.run([*MAKE, *server_settings(tmp_path, port), *extra], cwd=PROJECT_ROOT,
                              env={**env, **store_settings(tmp_path), **store}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0 and expected in done.stderr, done.stderr
        assert not _answers(port)
    # a store or auth database with a password on the command line, where ps shows it: refused, and not echoed
    for option in ("--store", "--auth-db"):
        done = subprocess.run([sys.executable, "-m", "pipeline", "server", option, "postgresql://u:pw1234@db/x",
                               "--artifacts", str(tmp_path / "art")], cwd=PROJECT_ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "postgresql://u:***@db/x" in done.stderr and "SERVER_" in done.stderr
        assert "pw1234" not in done.stderr + done.stdout


def test_the_servers_command_lines_hold_no_store_and_no_password(auth_server) -> None:
    """What `ps` shows every account of `make server`'s processes (make, python -m pipeline server, mlflow server,
    uvicorn): no store path, no auth database, no password."""
    group = [pid for pid in os.listdir("/proc") if pid.isdigit() and _process_group(pid) == auth_server["group"]]
    lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group]
    assert any(b"mlflow" in line and b"server" in line for line in lines), lines
    for line in lines:
        for secret in (auth_server["password"], str(auth_server["own"] / "mlflow.db"), "auth.db"):
            assert secret.encode() not in line, line


def _process_group(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


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
    # the fold job had a user made for the run, not the admin: it exists now, without admin rights
    status, users = auth_call(uri, "/api/2.0/mlflow/users/list", "admin", password)
    made = [user for user in users.get("users", []) if user["username"].startswith(JOB_USER_PREFIX)]
    assert status == 200 and len(made) == 1 and not made[0]["is_admin"], users
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(MlflowException):  # the same client without the password: refused
        MlflowClient(uri).get_run(parent.info.run_id)
    # the password is in no file of the store, the artifacts, the auth settings, the server's log or the CV's
    # work folder (fold job files, checkpoints)
    for path in [*auth_server["own"].rglob("*"), *(tmp_path / "runs").rglob("*")]:
        if path.is_file() and path.name != "admin password":
            assert password.encode() not in path.read_bytes(), path
