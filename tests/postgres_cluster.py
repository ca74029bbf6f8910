"""A real PostgreSQL (Debian's `postgresql` package) started and stopped by the tests: a cluster of its own in a
temporary folder, on 127.0.0.1 and a unix socket in that folder, with one role that logs in by password.

    with PostgresCluster() as cluster:           # initdb, pg_ctl start; a role and its databases
        cluster.uri("mlflow")                    # postgresql://painvit@127.0.0.1:<port>/mlflow (no password in it)
        cluster.new_database()                   # another one for another store: its URI
        cluster.password                         # what the role logs in with (scram-sha-256 over TCP)

initdb refuses to run as root: as root (CI) the cluster belongs to the `postgres` user the package creates, and its
programs run as that user through `runuser`; as anyone else they run as that user. Every failure raises RuntimeError
naming the step, with the program's output or the server log's tail. Durability is off (fsync, synchronous commit):
a test cluster lives for one session.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

ROLE = "painvit"


def postgres_bin() -> Path:
    """The folder of initdb / pg_ctl / psql: on PATH, else Debian's /usr/lib/postgresql/<newest>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not versions:
        raise RuntimeError("PostgreSQL test cluster: preflight: no initdb (apt-get install postgresql)")
    return versions[-1].parent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PostgresCluster:
    """initdb + pg_ctl in a folder of its own; `databases` created, owned by the password role ROLE."""

    def __init__(self, databases: tuple[str, ...] = ("mlflow",)) -> None:
        self.bin = postgres_bin()
        self.made = 0
        self.databases = databases
        self.password = secrets.token_urlsafe(18)
        self.port = _free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="painvit-pg-"))  # 0700; under /tmp, which `postgres` can reach
        self.data = self.folder / "data"
        self.owner = pwd.getpwnam("postgres") if os.geteuid() == 0 else None

    def _run(self, step: str, *command: str, timeout: float = 120) -> str:
        program = [str(self.bin / command[0]), *command[1:]]
        if self.owner is not None:  # root: as the cluster's owner
            program = ["runuser", "-u", "postgres", "--", *program]
        try:
            done = subprocess.run(program, capture_output=True, text=True, timeout=timeout, cwd=self.folder)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"PostgreSQL test cluster: {step}: {error}\n{self.log_tail()}") from error
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL test cluster: {step}: exit {done.returncode}\n{done.stdout}\n"
                               f"{done.stderr}\n{self.log_tail()}")
        return done.stdout

    def log_tail(self, lines: int = 30) -> str:
        path = self.folder / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def start(self) -> PostgresCluster:
        if self.owner is not None:
            os.chown(self.folder, self.owner.pw_uid, self.owner.pw_gid)
        self._run("initdb", "initdb", "-D", str(self.data), "-U", "postgres", "--auth-local=trust",
                  "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C")
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
        self._run("start", "pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options,
                  "-w", "-t", "60", "start")
        self.sql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{self.password}'")
        for database in self.databases:
            self.sql(f"CREATE DATABASE {database} OWNER {ROLE}")
        return self

    def sql(self, statement: str, database: str = "postgres") -> str:
        """One statement as the superuser, over the socket (trust: only `postgres` and root reach its folder)."""
        return self._run("psql", "psql", "-h", str(self.folder), "-p", str(self.port), "-U", "postgres", "-d",
                         database, "-v", "ON_ERROR_STOP=1", "-Atc", statement)

    def new_database(self, prefix: str = "mlflow") -> str:
        """A fresh database owned by the role (one per store a test needs): its URI."""
        self.made += 1
        name = f"{prefix}_{self.made}"
        self.sql(f"CREATE DATABASE {name} OWNER {ROLE}")
        return self.uri(name)

    def uri(self, database: str = "mlflow") -> str:
        """The database's URI with the role's name and no password (libpq finds that in PGPASSWORD or a .pgpass)."""
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{database}"

    def pgpass_line(self) -> str:
        return f"127.0.0.1:{self.port}:*:{ROLE}:{self.password}\n"

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("stop", "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
            except RuntimeError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PostgresCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()
