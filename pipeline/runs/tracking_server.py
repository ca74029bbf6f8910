"""`make server`: the MLflow tracking server for fold jobs on other nodes, asking who you are where others reach it.

On a loopback host (127.0.0.1, localhost, ::1) the server is started as before: open, since only this machine reaches
it. On any other host (`SERVER_HOST=0.0.0.0` on a login node) it runs MLflow's basic-auth app: every request needs a
user and password, the admin user is created on the first start from `MLFLOW_AUTH_ADMIN_PASSWORD` (MLflow's own
variable) or from `--admin-password-file`, a file only its owner may read; the password is never on a command line,
in a config file of ours or in a fold job file. MLflow's host check (`--allowed-hosts`: this machine's names on any
port unless given) and CORS origins (`--cors-allowed-origins`, none unless given) are set with it. `--auth off` on a
non-loopback host is refused unless `--insecure` (`SERVER_INSECURE=1`) says so.

Fold jobs and `make cv` authenticate through MLflow's own `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD`,
which the MLflow client reads from the environment (SLURM passes the environment to the array tasks).
`tracking_access_problem` is what `LAUNCHER=slurm` asks before it submits anything.

    python -m pipeline server --host 0.0.0.0 --port 5000 --store sqlite:///mlflow.db --artifacts mlartifacts
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import socket
import stat
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.runs.tracking import open_store
from pipeline.utils.atomic_io import atomic_path

ADMIN_PASSWORD_ENV = "MLFLOW_AUTH_ADMIN_PASSWORD"  # MLflow's own: the first admin's password
ADMIN_USERNAME_ENV = "MLFLOW_AUTH_ADMIN_USERNAME"
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"  # what clients send
INSECURE_ENV = "SERVER_INSECURE"  # 1: the user accepts an open tracking server reachable from other machines
SECRET_KEY_ENV = "MLFLOW_FLASK_SERVER_SECRET_KEY"  # MLflow's: signs the auth app's CSRF tokens
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")


class ServerSettingsError(ValueError):
    """A server setting that would leave the store open or a secret exposed: the message says what to do."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: a server only this machine reaches."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_secret_file(path: Path) -> str:
    """The first line of a file that only its owner (this user) can read or write; anything else is refused."""
    try:
        info = path.stat()
    except OSError as error:
        raise ServerSettingsError(f"secret file {path}: {error.strerror}") from None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ServerSettingsError(
            f"secret file {path} must belong to you and be readable by you only (chmod 600 {path}); it is "
            f"mode {stat.filemode(info.st_mode)}")
    lines = path.read_text().splitlines()
    if not lines or not lines[0].strip():
        raise ServerSettingsError(f"secret file {path} is empty")
    return lines[0].strip()


def default_allowed_hosts(host: str) -> list[str]:
    """The Host headers a request may carry: this machine's names and the bound address, on any port."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    if host not in ("0.0.0.0", "::", ""):
        names.add(host)
    return sorted(f"{name}:*" for name in names if name) + sorted(names)


def auth_config_text(database_uri: str, default_permission: str, admin_username: str) -> str:
    """MLflow's basic-auth settings (no password: MLflow reads that from the environment)."""
    return (f"[mlflow]\ndefault_permission = {default_permission}\ndatabase_uri = {database_uri}\n"
            f"admin_username = {admin_username}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")


def server_command(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command and its environment for these settings; errors say what to set."""
    env = {**environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", args.store, "--serve-artifacts",
               "--artifacts-destination", args.artifacts, "--host", args.host, "--port", str(args.port)]
    if args.workers:
        command += ["--workers", str(args.workers)]
    open_to_others = not is_loopback(args.host)
    auth = args.auth == "on" or (args.auth == "auto" and open_to_others)
    if open_to_others and not auth and not args.insecure:
        raise ServerSettingsError(
            f"a tracking server on {args.host} without authentication lets anyone who reaches the port read, change "
            f"and delete every run and model; drop SERVER_AUTH=off, or say SERVER_INSECURE=1 to run it open")
    if open_to_others or args.allowed_hosts:
        hosts = args.allowed_hosts or ",".join(default_allowed_hosts(args.host))
        command += ["--allowed-hosts", hosts]
    if args.cors_origins:
        command += ["--cors-allowed-origins", args.cors_origins]
    if not auth:
        return command, env
    if args.default_permission not in PERMISSIONS:
        raise ServerSettingsError(f"SERVER_DEFAULT_PERMISSION={args.default_permission}: one of "
                                  f"{', '.join(PERMISSIONS)}")
    if args.admin_password_file:
        env[ADMIN_PASSWORD_ENV] = read_secret_file(Path(args.admin_password_file).expanduser())
    first_start = not _auth_store_exists(args.auth_db)
    if first_start and not env.get(ADMIN_PASSWORD_ENV):
        raise ServerSettingsError(
            f"the first start of an authenticated server creates its admin user, and needs the password: export "
            f"{ADMIN_PASSWORD_ENV}=... (read it with `read -s`, not on the command line) or give "
            f"SERVER_ADMIN_PASSWORD_FILE=<a file only you can read>")
    config = Path(args.auth_config).expanduser().resolve()
    with atomic_path(config, mode=0o600) as tmp:
        tmp.write_text(auth_config_text(args.auth_db, args.default_permission, env.get(ADMIN_USERNAME_ENV) or "admin"))
    env["MLFLOW_AUTH_CONFIG_PATH"] = str(config)
    if not env.get(SECRET_KEY_ENV):  # CSRF protection's key: one per server, kept owner-only beside its settings
        env[SECRET_KEY_ENV] = flask_secret_key(config.with_suffix(".key"))
    command += ["--app-name", "basic-auth"]
    return command, env


def flask_secret_key(path: Path) -> str:
    """The key in `path` (owner-only), made on the first start; the same key across restarts keeps tokens valid."""
    if path.exists():
        return read_secret_file(path)
    key = secrets.token_hex(32)
    with atomic_path(path, mode=0o600) as tmp:
        tmp.write_text(key + "\n")
    return key


def _auth_store_exists(database_uri: str) -> bool:
    """Whether the auth database is there already (then MLflow ignores the admin password); non-sqlite: assume so."""
    if not database_uri.startswith("sqlite:///"):
        return True
    return Path(database_uri.removeprefix("sqlite:///")).exists()


def uri_has_credentials(uri: str) -> bool:
    """An http(s) URI with a user or password in it (`http://user:pass@host`); database URIs are the store's own."""
    parts = urlsplit(uri)
    return parts.scheme in ("http", "https") and bool(parts.username or parts.password)


def tracking_access_problem(uri: str, environ: Mapping[str, str] | None = None, timeout_s: float = 10) -> str | None:
    """Why fold jobs on other nodes must not use the tracking server at `uri`, or None. Credentials in the URI are
    refused (it is written into job files and run tags); an open server reachable from other machines is refused
    unless SERVER_INSECURE=1; an authenticated one needs MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD."""
    environ = os.environ if environ is None else environ
    parts = urlsplit(uri)
    if uri_has_credentials(uri):
        return (f"the tracking URI carries credentials; it is written into job files and run tags. Use "
                f"{USERNAME_ENV} and {PASSWORD_ENV} instead, and a URI without them")
    status = probe_status(uri, timeout_s)
    if status in (401, 403):
        if not (environ.get(USERNAME_ENV) and environ.get(PASSWORD_ENV)):
            return (f"the tracking server {uri} asks who you are: export {USERNAME_ENV}=<user> and "
                    f"{PASSWORD_ENV}=<password> (the fold jobs inherit them)")
        return None
    if status is None:
        return f"the tracking server {uri} does not answer"
    if not is_loopback(parts.hostname or "") and environ.get(INSECURE_ENV, "") != "1":
        return (f"the tracking server {uri} answers without authentication, so anyone on the network can change or "
                f"delete its runs: start it with `make server` on that host (authentication on), or say "
                f"{INSECURE_ENV}=1 to use it open")
    return None


def probe_status(uri: str, timeout_s: float = 10) -> int | None:
    """The HTTP status of an unauthenticated read of the store (one experiment search); None if nothing answers."""
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(prog="python -m pipeline server", description="the tracking server of make server")
    parse.add_argument("--host", default="127.0.0.1")
    parse.add_argument("--port", type=int, default=5000)
    parse.add_argument("--store", required=True, help="backend store URI")
    parse.add_argument("--artifacts", required=True, help="artifact destination (served by the server)")
    parse.add_argument("--workers", type=int, default=0, help="0: MLflow's default")
    parse.add_argument("--auth", choices=("auto", "on", "off"), default="auto",
                       help="auto: on unless the host is loopback")
    parse.add_argument("--auth-db", default=f"sqlite:///{Path.cwd() / 'mlflow-auth.db'}")
    parse.add_argument("--auth-config", default=str(Path.cwd() / "mlflow-auth.ini"))
    parse.add_argument("--admin-password-file", default="")
    parse.add_argument("--default-permission", default="READ")
    parse.add_argument("--allowed-hosts", default="")
    parse.add_argument("--cors-origins", default="")
    parse.add_argument("--insecure", action="store_true")
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.insecure = args.insecure or os.environ.get(INSECURE_ENV, "") == "1"
    try:
        command, env = server_command(args, os.environ)
    except ServerSettingsError as error:
        print(f"server: {error}", file=sys.stderr)
        return 2
    open_store(args.store)  # a new sqlite store is created here, under its lock, not by the server
    auth = "--app-name" in command
    print(f"MLflow tracking server on http://{args.host}:{args.port} over {args.store} "
          f"({'basic authentication' if auth else 'open: loopback only' if is_loopback(args.host) else 'OPEN'})",
          flush=True)
    os.execve(command[0], command, env)
    return 0  # not reached
