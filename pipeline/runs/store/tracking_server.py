"""`make server` and the helpers of the servers a run starts: MLflow tracking servers that ask who you are,
on loopback too, since on a login node every other account reaches 127.0.0.1.

`make server` runs MLflow's basic-auth app on every host: every request needs a user and password, the admin user is
created on the first start from `MLFLOW_AUTH_ADMIN_PASSWORD` (MLflow's own variable) or from
`--admin-password-file`, a file only its owner may read. The store and the auth database come from the environment
(`SERVER_STORE`, `SERVER_AUTH_DB`, which `make server` puts there), and reach `mlflow server` through MLflow's own
variables: the command line, which `ps` shows to every account, holds neither (`--store` / `--auth-db` with a password
in them are refused). MLflow's host check (`--allowed-hosts`: this machine's names on any port unless given) and CORS
origins (`--cors-allowed-origins`, none unless given) are set off loopback. `--auth off` is refused unless
`--insecure` (`SERVER_INSECURE=1`) says so.

The servers a run starts for itself (the parallel launcher's, `make tune LAUNCHER=parallel`'s, `make ui`'s:
`private_server.tracking_server`) are private ones (`private_server_environment`): their users and settings in a 0700
folder of their own, a random admin password and CSRF key in their environment only. Fold jobs never get an admin's
password: they get a user made for the run with EDIT on the run's experiments (`make_run_user`), on a private server
or on one the user started with `make server` (`job_credentials`), through their environment only.

Clients authenticate through MLflow's own `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD`.
`tracking_access_problem` is what `LAUNCHER=slurm` asks before it submits anything.

    SERVER_STORE=sqlite:///mlflow.db python -m pipeline server --host 0.0.0.0 --port 5000 --artifacts mlartifacts
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import os
import secrets
import socket
import stat
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from pipeline.runs.store.tracking import (
    open_store,
    redact_uri,
    sqlite_file,
    uri_has_credentials,
)
from pipeline.utils.atomic_io import atomic_path
from pipeline.utils.permissions import StoreNotPrivate, refuse_open_stores

ADMIN_PASSWORD_ENV = "MLFLOW_AUTH_ADMIN_PASSWORD"  # MLflow's own: the first admin's password
ADMIN_USERNAME_ENV = "MLFLOW_AUTH_ADMIN_USERNAME"
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"  # what clients send
INSECURE_ENV = "SERVER_INSECURE"  # 1: the user accepts an open tracking server
SECRET_KEY_ENV = "MLFLOW_FLASK_SERVER_SECRET_KEY"  # MLflow's: signs the auth app's CSRF tokens
AUTH_CONFIG_ENV = "MLFLOW_AUTH_CONFIG_PATH"  # MLflow's: the auth app's settings file
# where `python -m pipeline server` reads the store and the auth database (`make server` sets them), and where
# `mlflow server` reads the store and the artifact destination: never argv
STORE_ENV, AUTH_DB_ENV = "SERVER_STORE", "SERVER_AUTH_DB"
BACKEND_STORE_ENV, ARTIFACT_ROOT_ENV = "MLFLOW_BACKEND_STORE_URI", "MLFLOW_DEFAULT_ARTIFACT_ROOT"
ARTIFACTS_DESTINATION_ENV = "MLFLOW_ARTIFACTS_DESTINATION"
# Variables that hold a secret: none of them reaches a fold job or a server that does not need it
# libpq's (PostgreSQL) and MySQL's password variables: a tracking server over such a database needs its own (or
# libpq's password file, ~/.pgpass or PGPASSFILE, which is not a secret in itself); a fold job never does
DATABASE_PASSWORD_ENV = ("PGPASSWORD", "MYSQL_PWD")
CREDENTIAL_ENV = (PASSWORD_ENV, USERNAME_ENV, "MLFLOW_TRACKING_TOKEN", ADMIN_PASSWORD_ENV, ADMIN_USERNAME_ENV,
                  SECRET_KEY_ENV, *DATABASE_PASSWORD_ENV)
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")
JOB_USER_PREFIX = "painvit-jobs"  # the users made for a run's fold jobs
# a private server checks each (user, password) pair's scrypt hash once per this many seconds, not per request (one
# worker: no other worker's cache can go stale); a fold job makes hundreds of requests
PRIVATE_AUTH_CACHE_S = 3600


class ServerSettingsError(ValueError):
    """A server setting that would leave the store open or a secret exposed: the message says what to do."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: a server only this machine reaches (every account on it, though)."""
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


def auth_config_text(database_uri: str, default_permission: str, admin_username: str, cache_s: int = 0) -> str:
    """MLflow's basic-auth settings (no password: MLflow reads that from the environment). `cache_s` > 0: a
    verified (user, password) pair is trusted that long in the worker that checked it (MLflow's auth cache)."""
    return (f"[mlflow]\ndefault_permission = {default_permission}\ndatabase_uri = {database_uri}\n"
            f"admin_username = {admin_username}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            + (f"auth_cache_ttl_seconds = {cache_s}\n" if cache_s > 0 else ""))


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less every variable that holds a secret (CREDENTIAL_ENV) and a tracking or registry URI that
    carries a password: what a fold job or a private server may inherit."""
    return {key: value for key, value in environ.items() if key not in CREDENTIAL_ENV
            and not (key in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI") and redact_uri(value) != value)}


def server_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a private tracking server inherits: `without_credentials`, but the database's password variables
    (DATABASE_PASSWORD_ENV) kept, since the server, and it alone, opens the store."""
    return {**without_credentials(environ),
            **{key: environ[key] for key in DATABASE_PASSWORD_ENV if key in environ}}


def server_command(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command and its environment for these settings; errors say what to set. The store and
    the artifact destination travel in the environment, the auth database in an owner-only settings file."""
    env = {**environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", BACKEND_STORE_ENV: args.store,
           ARTIFACTS_DESTINATION_ENV: args.artifacts}
    command = [sys.executable, "-m", "mlflow", "server", "--serve-artifacts", "--host", args.host,
               "--port", str(args.port)]
    if args.workers:
        command += ["--workers", str(args.workers)]
    open_to_others = not is_loopback(args.host)
    auth = args.auth != "off"
    if not auth and not args.insecure:
        where = f"anyone who reaches {args.host}:{args.port}" if open_to_others else \
            "every account on this machine (loopback is shared by all of them)"
        raise ServerSettingsError(
            f"a tracking server without authentication lets {where} read, change and delete every run and model; "
            f"drop SERVER_AUTH=off, or say SERVER_INSECURE=1 to run it open")
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
    env[AUTH_CONFIG_ENV] = str(config)
    if not env.get(SECRET_KEY_ENV):  # CSRF protection's key: one per server, kept owner-only beside its settings
        env[SECRET_KEY_ENV] = flask_secret_key(config.with_suffix(".key"))
    command += ["--app-name", "basic-auth"]
    return command, env


def private_server_environment(folder: Path, default_permission: str = "NO_PERMISSIONS") -> dict[str, str]:
    """The variables of a basic-auth server made for one run, its users and settings in `folder` (which must be this
    user's, 0700): a fresh auth database, a random admin password and CSRF key that live in the returned mapping
    only (the settings file holds neither). The admin is `admin`; `make_run_user` adds the fold jobs' user."""
    if stat.S_IMODE(folder.stat().st_mode) != 0o700:
        raise ServerSettingsError(f"{folder}: a private server's folder must be mode 700")
    config = folder / "auth.ini"
    with atomic_path(config, mode=0o600) as tmp:
        tmp.write_text(auth_config_text(f"sqlite:///{folder / 'auth.db'}", default_permission, "admin",
                                        cache_s=PRIVATE_AUTH_CACHE_S))
    return {AUTH_CONFIG_ENV: str(config), ADMIN_USERNAME_ENV: "admin", ADMIN_PASSWORD_ENV: secrets.token_urlsafe(24),
            SECRET_KEY_ENV: secrets.token_hex(32)}


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
    path = sqlite_file(database_uri)
    return path.exists() if path is not None else not database_uri.startswith("sqlite:")


def _basic_auth(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def auth_call(uri: str, path: str, user: str, password: str, body: dict | None = None,
              query: dict | None = None, timeout_s: float = 30) -> tuple[int, dict]:
    """One call of MLflow's auth REST API as `user`: POST of a JSON `body`, else GET with `query`. The status and the
    JSON answer ({} when there is none)."""
    url = f"{uri.rstrip('/')}{path}" + (f"?{urlencode(query)}" if query else "")
    headers = _basic_auth(user, password)
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            text = answer.read()
            return int(answer.status), json.loads(text) if text.strip() else {}
    except urllib.error.HTTPError as error:
        return int(error.code), {}


def make_run_user(uri: str, admin: tuple[str, str], experiment_ids: Sequence[str]) -> dict[str, str]:
    """A user made for one run on the server at `uri`, by its admin, with EDIT on `experiment_ids` (and what the
    server's default permission gives on the others): the credentials its fold jobs get, as MLflow's variables."""
    username, password = f"{JOB_USER_PREFIX}-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    status, _ = auth_call(uri, "/api/2.0/mlflow/users/create", *admin, {"username": username, "password": password})
    if status != 200:
        raise RuntimeError(f"the tracking server {redact_uri(uri)} did not create the fold jobs' user (HTTP {status})")
    for experiment_id in experiment_ids:
        status, _ = auth_call(uri, "/api/3.0/mlflow/users/permissions/grant", *admin,
                              {"username": username, "resource_type": "experiment", "resource_id": str(experiment_id),
                               "permission": "EDIT"})
        if status != 200:
            raise RuntimeError(f"the tracking server {redact_uri(uri)} did not let the fold jobs' user edit "
                               f"experiment {experiment_id} (HTTP {status})")
    return {USERNAME_ENV: username, PASSWORD_ENV: password}


def job_credentials(uri: str, experiment_ids: Sequence[str], environ: Mapping[str, str] | None = None
                    ) -> dict[str, str]:
    """The credentials fold jobs get for the server at `uri` (an http(s) one the user runs, e.g. `make server`),
    from this user's MLFLOW_TRACKING_USERNAME / _PASSWORD: where those are an admin's, a user made for the run
    (`make_run_user`), so that the admin's password reaches no job; a user's own otherwise; none without them."""
    environ = os.environ if environ is None else environ
    user, password = environ.get(USERNAME_ENV, ""), environ.get(PASSWORD_ENV, "")
    if not (user and password and uri.startswith(("http://", "https://"))):
        return {}
    status, answer = auth_call(uri, "/api/2.0/mlflow/users/get", user, password, query={"username": user})
    if status == 200 and answer.get("user", {}).get("is_admin"):
        return make_run_user(uri, (user, password), experiment_ids)
    return {USERNAME_ENV: user, PASSWORD_ENV: password}


def tracking_access_problem(uri: str, environ: Mapping[str, str] | None = None, timeout_s: float = 10) -> str | None:
    """Why fold jobs on other nodes must not use the tracking server at `uri`, or None. Credentials in the URI are
    refused (it is written into job files and run tags); an open server reachable from other machines is refused
    unless SERVER_INSECURE=1; an authenticated one needs MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD."""
    environ = os.environ if environ is None else environ
    parts = urlsplit(uri)
    shown = redact_uri(uri)
    if uri_has_credentials(uri):
        return (f"the tracking URI carries credentials; it is written into job files and run tags. Use "
                f"{USERNAME_ENV} and {PASSWORD_ENV} instead, and a URI without them")
    status = probe_status(uri, timeout_s)
    if status in (401, 403):
        if not (environ.get(USERNAME_ENV) and environ.get(PASSWORD_ENV)):
            return (f"the tracking server {shown} asks who you are: export {USERNAME_ENV}=<user> and "
                    f"{PASSWORD_ENV}=<password> (the fold jobs get a user made for the run when yours is an admin)")
        return None
    if status is None:
        return f"the tracking server {shown} does not answer"
    if not is_loopback(parts.hostname or "") and environ.get(INSECURE_ENV, "") != "1":
        return (f"the tracking server {shown} answers without authentication, so anyone on the network can change "
                f"or delete its runs: start it with `make server` on that host (authentication on), or say "
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
    parse.add_argument("--store", default="", help=f"backend store URI (default: ${STORE_ENV}; a password in it "
                                                   f"is refused here, where ps shows it)")
    parse.add_argument("--artifacts", required=True, help="artifact destination (served by the server)")
    parse.add_argument("--workers", type=int, default=0, help="0: MLflow's default")
    parse.add_argument("--auth", choices=("auto", "on", "off"), default="auto",
                       help="auto, on: basic authentication (on loopback too); off: refused unless --insecure")
    parse.add_argument("--auth-db", default="", help=f"auth database URI (default: ${AUTH_DB_ENV}, else "
                                                     f"sqlite:///<cwd>/mlflow-auth.db)")
    parse.add_argument("--auth-config", default=str(Path.cwd() / "mlflow-auth.ini"))
    parse.add_argument("--admin-password-file", default="")
    parse.add_argument("--default-permission", default="READ")
    parse.add_argument("--allowed-hosts", default="")
    parse.add_argument("--cors-origins", default="")
    parse.add_argument("--insecure", action="store_true")
    return parse


def server_settings(argv: Sequence[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
    """The parsed settings, the store and auth database from the environment unless given (without a password)."""
    args = parser().parse_args(argv)
    args.insecure = args.insecure or environ.get(INSECURE_ENV, "") == "1"
    for option, variable in (("store", STORE_ENV), ("auth_db", AUTH_DB_ENV)):
        given = getattr(args, option)
        if given and uri_has_credentials(given):
            raise ServerSettingsError(
                f"--{option.replace('_', '-')} {redact_uri(given)}: a password on the command line is shown by ps "
                f"to every account; give the URI in {variable} (`make server` does) or the password in ~/.pgpass")
        setattr(args, option, given or environ.get(variable, ""))
    if not args.store:
        raise ServerSettingsError(f"no store: set {STORE_ENV}=<backend store URI> (`make server` sets it)")
    args.auth_db = args.auth_db or f"sqlite:///{Path.cwd() / 'mlflow-auth.db'}"
    return args


def server_files(args: argparse.Namespace) -> list[Path]:
    """The files and folders of the store a server writes (sqlite store and auth database, local artifacts)."""
    paths = [sqlite_file(args.store), sqlite_file(args.auth_db)]
    if "://" not in args.artifacts:
        paths.append(Path(args.artifacts))
    return [path for path in paths if path is not None]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = server_settings(argv, os.environ)
        refuse_open_stores(server_files(args))
        command, env = server_command(args, os.environ)
    except (ServerSettingsError, StoreNotPrivate) as error:
        print(f"server: {error}", file=sys.stderr)
        return 2
    open_store(args.store)  # a new sqlite store is created here, under its lock, not by the server
    auth = "--app-name" in command
    print(f"MLflow tracking server on http://{args.host}:{args.port} over {redact_uri(args.store)} "
          f"({'basic authentication' if auth else 'OPEN'})", flush=True)
    os.execve(command[0], command, env)
    return 0  # not reached
