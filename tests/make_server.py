"""`make server` as the tests run it: on loopback, its store and auth database given in the environment (never on
make's command line), its admin's password in an owner-only file; started, killed with SIGKILL, started again on the
same port over the same store.

    server = MakeServer(folder, {"SERVER_STORE": ..., "SERVER_AUTH_DB": ...})
    server.start()             # waits for /health; server.uri, server.admin (user, password)
    server.kill()              # SIGKILL to make and everything it started (the MLflow server and its workers)
    server.start()             # the same port and store
    server.stop()
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group

MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed", "server"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def status_of(url: str, user: str = "", password: str = "") -> int:
    """The HTTP status of a GET (with basic authentication when a user is given); 0 when nothing answers."""
    headers = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()} if user else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def process_group(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


class MakeServer:
    def __init__(self, folder: Path, store_env: dict[str, str], extra_env: dict[str, str] | None = None) -> None:
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(18)
        self.admin = ("admin", self.password)
        self.secret = folder / "admin password"
        self.secret.write_text(self.password + "\n")
        self.secret.chmod(0o600)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_AUTH", "MLFLOW_TRACKING"))}
        self.env.update({"PYTHONPATH": str(PROJECT_ROOT), **store_env, **(extra_env or {})})
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.folder / f"server_{self.starts}.log"

    def command(self) -> list[str]:
        return [*MAKE, f"SERVER_PORT={self.port}", f"SERVER_ARTIFACTS={self.folder / 'art'}",
                f"SERVER_AUTH_CONFIG={self.folder / 'auth.ini'}", "SERVER_WORKERS=1",
                f"SERVER_ADMIN_PASSWORD_FILE={self.secret}"]

    def start(self, timeout_s: float = 180) -> MakeServer:
        self.starts += 1
        with self.log.open("w") as log:
            self.process = subprocess.Popen(self.command(), cwd=PROJECT_ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while status_of(f"{self.uri}/health") != 200:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"make server did not answer /health within {timeout_s:.0f} s"
            time.sleep(0.5)
        return self

    def group(self) -> list[str]:
        """The process ids of make server's group (make, the MLflow server and its workers)."""
        assert self.process is not None
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and process_group(pid) == self.process.pid]

    def kill(self) -> None:
        """SIGKILL to the whole group, as when its node loses power or the OOM killer strikes; gone once it returns."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.group() or status_of(f"{self.uri}/health") != 0:
            assert time.monotonic() < deadline, "make server's processes outlived SIGKILL"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            stop_process_group(self.process, grace_s=15)
