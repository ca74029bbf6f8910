"""The private tracking server of one run: the parallel launcher's, `make tune LAUNCHER=parallel`'s and `make ui`'s
(`tracking_server`), an MLflow basic-auth server on loopback over the run's store, its settings and users in a 0700
folder of its own, a random admin password, and a user made for the run's jobs (`tracking_server.make_run_user`).
Below the launchers, which start it for their jobs, and beside `make ui`, which starts it for a person."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.runs.store.tracking import (
    DEFAULT_EXPERIMENT,
    artifact_folder,
    artifact_root,
    open_store,
    redact_uri,
    sqlite_file,
    tracking_uri,
)
from pipeline.runs.store.tracking_server import (
    ADMIN_PASSWORD_ENV,
    ADMIN_USERNAME_ENV,
    ARTIFACT_ROOT_ENV,
    BACKEND_STORE_ENV,
    PASSWORD_ENV,
    USERNAME_ENV,
    make_run_user,
    private_server_environment,
    server_environment,
)
from pipeline.runs.store.ui_pages import ui_urls
from pipeline.utils.atomic_io import atomic_path
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.permissions import PRIVATE_UMASK, StoreNotPrivate, refuse_open_stores
from pipeline.utils.processes import die_with_parent, interrupt_on, stop_process_group

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _private_child() -> None:
    """In a server started here: what it creates (a new sqlite store, its journal, artifacts) is this user's alone,
    whatever umask the caller had; and it dies with its parent (Linux)."""
    os.umask(PRIVATE_UMASK)
    if sys.platform == "linux":
        die_with_parent()


@dataclass
class TrackingServer:
    """A private tracking server of one run: its address, the credentials its fold jobs get (a user made for the
    run; empty when no experiment was named), its admin (for the owner alone: `make ui`) and its 0700 folder."""

    uri: str
    credentials: dict[str, str]
    admin: tuple[str, str]
    folder: Path
    process: subprocess.Popen

    @property
    def admin_credentials(self) -> dict[str, str]:
        return {USERNAME_ENV: self.admin[0], PASSWORD_ENV: self.admin[1]}

    def running(self) -> bool:
        return self.process.poll() is None


@contextlib.contextmanager
def tracking_server(backend_store_uri: str, artifact_root: str, port: int | None = None,
                    host: str = "127.0.0.1", timeout_s: float = 120, experiment_ids: Sequence[str] = (),
                    default_permission: str = "NO_PERMISSIONS") -> Iterator[TrackingServer]:
    """A private MLflow tracking server over `backend_store_uri` for as long as the block runs.

    MLflow's basic-auth app on loopback too (other accounts on this machine reach 127.0.0.1): users and settings in a
    0700 folder of its own, a random admin password, and a user made for the run with EDIT on `experiment_ids`,
    whose credentials are what the fold jobs get (`job_environment`). The store URI, the artifact root and every
    secret reach the server through its environment, never its command line (`ps` shows that to everyone); what it
    creates is this user's alone. One worker and no job runner (one driver's fold jobs are all it serves). Stopped at
    the end of the block, on errors and Ctrl-C too; if this process is killed the server dies with it (Linux).
    """
    open_store(backend_store_uri)  # a new sqlite store is created here, under its lock, not by the server
    port = port or free_port(host)
    folder = Path(tempfile.mkdtemp(prefix="painvit-server-"))  # 0700, this user's
    secrets_env = private_server_environment(folder, default_permission)
    command = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1",
               "--app-name", "basic-auth"]
    env = {**server_environment(os.environ), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           BACKEND_STORE_ENV: backend_store_uri, ARTIFACT_ROOT_ENV: artifact_root, **secrets_env}
    admin = (secrets_env[ADMIN_USERNAME_ENV], secrets_env[ADMIN_PASSWORD_ENV])
    started = time.time()
    # its log goes to a file: a pipe nobody reads would fill up with access lines and stall the server
    server_log = folder / "server.log"
    with open(server_log, "wb") as log_file:
        server = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                  preexec_fn=_private_child, start_new_session=True)
    uri = f"http://{host}:{port}"
    shown = redact_uri(backend_store_uri)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the MLflow server on {uri} over {shown} exited with code {server.returncode}: "
                                   f"{log_tail(server_log, 30)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.time() - started > timeout_s:
                raise RuntimeError(f"the MLflow server on {uri} did not answer within {timeout_s:.0f} s")
            time.sleep(0.5)
        credentials = make_run_user(uri, admin, experiment_ids) if experiment_ids else {}
        log.info("MLflow server %s over %s answered after %.1f s", uri, shown, time.time() - started)
        yield TrackingServer(uri, credentials, admin, folder, server)
    finally:
        stop_process_group(server, grace_s=15)
        shutil.rmtree(folder, ignore_errors=True)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file ("" where there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def ui_main(argv: Sequence[str] | None = None) -> int:
    """`make ui`: the runs page's address, then the UI on loopback as a private server for as long as it runs: user
    `admin`, whose random password is in an owner-only file that goes when the UI stops."""
    parse = argparse.ArgumentParser(prog="python -m pipeline ui", description="the MLflow UI, asking who you are")
    parse.add_argument("--port", type=int, default=5000)
    parse.add_argument("--experiment", default=DEFAULT_EXPERIMENT)
    args = parse.parse_args(argv)
    store = tracking_uri(PROJECT_ROOT)  # MLFLOW_TRACKING_URI or the project's mlflow.db: never on a command line
    if store.startswith(("http://", "https://")):
        print(f"ui: the store is the tracking server {redact_uri(store)}: open its own UI", file=sys.stderr)
        return 2
    try:
        refuse_open_stores([path for path in (sqlite_file(store), artifact_folder(PROJECT_ROOT)) if path is not None])
    except StoreNotPrivate as error:
        print(f"ui: {error}", file=sys.stderr)
        return 2
    url, *comparisons = ui_urls(store, "127.0.0.1", args.port, args.experiment)
    # Ctrl+C, `kill` or a closed terminal: the server stopped and the password's folder removed, even where this
    # process was started with SIGINT ignored (the background of a script)
    interrupt_on(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        with tracking_server(store, artifact_root(PROJECT_ROOT), port=args.port, default_permission="READ") as served:
            secret = served.folder / "password"
            with atomic_path(secret, mode=0o600) as tmp:
                tmp.write_text(served.admin[1] + "\n")
            print(f"MLflow UI over {redact_uri(store)}: {url}", flush=True)
            for address in comparisons:
                print(f"comparisons (make compare): {address}")
            print(f"log in as `{served.admin[0]}` with the password in {secret} (readable by you alone; it goes when "
                  f"the UI stops). Stop with Ctrl+C.", flush=True)
            while served.running():
                time.sleep(1)
            print("ui: the MLflow server stopped", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
