"""The store is the owner's and credentials do not leak, tested against the real thing: a second local account (made
here with useradd, removed after) on the same machine, the real CLI under the usual umask 022, a real private MLflow
server of the parallel launcher with fold jobs in processes of their own, and a postgres-style store URI with a
password given as the store a fold run tags (there is no PostgreSQL client here: the records go to sqlite, while the
job file, the tag, the logs and the jobs' environments are the real ones)."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.runs.jobs.fold_run import FoldJob, result_from_run
from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.cross_validation import plan_cv
from pipeline.runs.orchestration.cv_settings import CvRunSettings
from pipeline.runs.orchestration.search_workers import TuneWorker
from pipeline.runs.store import private_server, tracking
from pipeline.runs.store.tracking_server import ADMIN_PASSWORD_ENV, PASSWORD_ENV, USERNAME_ENV, auth_call
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.permissions import SHARED_OK_ENV
from tests.conftest import tiny_overrides
from tests.test_cv import FAST

ONE_FOLD = (*[o for o in FAST if not o.startswith(("trainer.folds", "trainer.max_epochs"))], "trainer.folds=[0]",
            "trainer.max_epochs=1")
# The other account's probes run in the system's Python (the project's environment may sit in root's home)
PROBE_PYTHON = "/usr/bin/python3"
PROBE = r"""
import json, os, sys, urllib.error, urllib.request
seen = {}
for target in sys.argv[1:]:
    try:
        if target.startswith("http"):
            with urllib.request.urlopen(target, timeout=20) as answer:
                seen[target] = answer.status
        elif os.path.isdir(target):
            seen[target] = "listed %d" % len(os.listdir(target))
        else:
            with open(target, "rb") as handle:
                seen[target] = "read %d" % len(handle.read(64))
    except urllib.error.HTTPError as error:
        seen[target] = error.code
    except PermissionError:
        seen[target] = "denied"
print(json.dumps(seen))
"""


class Stranger:
    """Another local account: what it sees of the files and servers of this one."""

    def __init__(self, name: str) -> None:
        self.name = name

    def probe(self, *targets: str | Path) -> dict:
        """For each path, `denied` or what it could list or read; for each http URL, the status it got."""
        done = subprocess.run([PROBE_PYTHON, "-I", "-c", PROBE, *map(str, targets)], user=self.name,
                              group=pwd.getpwnam(self.name).pw_gid, extra_groups=[], cwd="/", capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def stranger():
    """A second local account for the module; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a second local account is made with useradd, which needs root")
    if not (shutil.which("useradd") and shutil.which("userdel") and Path(PROBE_PYTHON).exists()):
        pytest.skip(f"needs useradd, userdel and {PROBE_PYTHON}")
    name = f"painvit{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True, timeout=60)
    try:
        yield Stranger(name)
    finally:
        subprocess.run(["userdel", name], check=False, timeout=60)


@pytest.fixture
def open_folder():
    """A project folder that other accounts may enter and list, as a home or group folder often is (pytest's own
    temporary folders are 0700, which would hide everything inside whatever its modes)."""
    folder = Path(tempfile.mkdtemp(prefix="painvit-project-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_redact_uri_hides_the_password_of_every_scheme() -> None:
    assert tracking.redact_uri("postgresql://mlflow:s3cr%40t@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert tracking.redact_uri("postgresql+psycopg2://u:p@ss@db/x") == "postgresql+psycopg2://u:***@db/x"
    assert tracking.redact_uri("mysql+pymysql://root:pw@127.0.0.1/m?charset=utf8") == \
        "mysql+pymysql://root:***@127.0.0.1/m?charset=utf8"
    assert tracking.redact_uri("https://admin:pw@mlflow.lab:443/") == "https://admin:***@mlflow.lab:443/"
    assert tracking.redact_uri("http://me:pw@[::1]:5000") == "http://me:***@[::1]:5000"
    assert tracking.redact_uri("postgresql://db/x?sslmode=require&password=pw&Token=t") == \
        "postgresql://db/x?sslmode=require&password=***&Token=***"
    for plain in ("sqlite:////home/me/mlflow.db", "postgresql://mlflow@db/mlflow", "http://127.0.0.1:5000",
                  "file:///tmp/mlruns", "databricks", "mlartifacts"):
        assert tracking.redact_uri(plain) == plain  # nothing to hide: unchanged
        assert not tracking.uri_has_credentials(plain)
    assert tracking.uri_has_credentials("mysql://u:pw@h/d")


def test_job_files_hold_no_password(tmp_path) -> None:
    """The fold job's and the search worker's files: a tracking URI with a password is refused (the job reaches its
    server through the credentials in its environment), the store it tags is written redacted."""
    job = FoldJob({}, 0, "parent", "http://127.0.0.1:5000", str(tmp_path / "fold_0"),
                  decisions=None, store_uri="postgresql://u:pw@db/mlflow")  # type: ignore[arg-type]
    written = json.loads(job.write(tmp_path / "fold_0.json").read_text())
    assert written["store_uri"] == "postgresql://u:***@db/mlflow" and "pw" not in (tmp_path / "fold_0.json").read_text()
    assert stat.S_IMODE((tmp_path / "fold_0.json").stat().st_mode) == 0o600
    with pytest.raises(ValueError, match=r"postgresql://u:\*\*\*@db/mlflow carries a password"):
        replace(job, tracking_uri="postgresql://u:pw@db/mlflow").write(tmp_path / "fold_1.json")
    worker = TuneWorker({}, [], [], "journal", "tuning", "mysql://u:pw@db/m", str(tmp_path), {})
    with pytest.raises(ValueError, match="carries a password"):
        worker.write(tmp_path / "worker_0.json")
    assert not (tmp_path / "fold_1.json").exists() and not (tmp_path / "worker_0.json").exists()


def _cli(base: Path, command: str, *overrides: str, env: dict[str, str] | None = None,
         raw: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m pipeline <command>` over the paths under `base` (the raw twin from `raw` if given), started under
    umask 022 as a login shell would."""
    settings = [o for o in tiny_overrides(base, *overrides) if not (raw and o.startswith("data.root="))]
    settings += [f"data.root={raw}"] if raw else []
    return subprocess.run([sys.executable, "-m", "pipeline", command, *settings], cwd=PROJECT_ROOT, umask=0o022,
                          env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **(env or {})}, capture_output=True,
                          text=True, timeout=900)


def test_a_store_others_can_read_is_refused_with_its_path_and_mode(tiny_base, tmp_path, capsys, monkeypatch) -> None:
    """A group- or world-readable sqlite store, runs, artifact or crops folder: the command (`pipeline.cli.main`, as
    `python -m pipeline` runs it) is refused before anything is read, with the path, its mode and what to do;
    PAINVIT_STORE_SHARED_OK=1 lets it go on. The raw twin (readable by others here) is no store: not refused."""
    from pipeline.cli import main

    base = tmp_path / "project"
    open_raw = tmp_path / "raw"
    shutil.copytree(tiny_base / "raw", open_raw)
    subprocess.run(["chmod", "-R", "go+rX", str(open_raw)], check=True)
    settings = [o for o in tiny_overrides(base) if not o.startswith("data.root=")] + [f"data.root={open_raw}"]
    for name, mode in (("mlflow.db", 0o640), ("runs", 0o750), ("mlartifacts", 0o707), ("processed", 0o755)):
        target = base / name
        base.mkdir(mode=0o700, exist_ok=True)
        if name.endswith(".db"):
            target.write_bytes(b"")
        else:
            target.mkdir()
        target.chmod(mode)
        assert main(["compare", *settings]) == 2
        refusal = capsys.readouterr().err
        assert f"{target} is {stat.filemode(target.stat().st_mode)} ({mode:04o})" in refusal
        assert f"chmod -R go-rwx {target}" in refusal and f"{SHARED_OK_ENV}=1" in refusal
        target.chmod(0o600 if name.endswith(".db") else 0o700)  # this one mended: the next is found
    monkeypatch.setenv(SHARED_OK_ENV, "1")
    (base / "runs").chmod(0o755)
    with pytest.raises(SystemExit, match="no MLflow experiment 'pain-cv'"):  # it went on, to the comparison
        main(["compare", *settings])


def test_commands_create_what_other_accounts_cannot_read(tiny_base, stranger, open_folder) -> None:
    """`make cv` started under umask 022 in a folder others can enter: the crops, the sqlite store, the artifacts
    (the kept model) and the runs folder it creates are this user's alone, and the second account is denied each."""
    open_raw = open_folder / "raw"
    shutil.copytree(tiny_base / "raw", open_raw)
    subprocess.run(["chmod", "-R", "go+rX", str(open_raw)], check=True)  # the twin readable by all: not a store
    done = _cli(open_folder, "cv", *ONE_FOLD, "cv.log_models=true", raw=open_raw)
    assert done.returncode == 0, done.stderr[-3000:]
    made = [path for path in open_folder.rglob("*") if not path.is_relative_to(open_raw)]
    assert any(path.name == "model.pt" for path in made) and any(path.suffix == ".jpg" for path in made)
    opened = [path for path in made if path.is_dir() and path.stat().st_mode & 0o077]
    assert not opened, [f"{path} {stat.filemode(path.stat().st_mode)}" for path in opened]
    # every file made is the owner's alone: through its folders (MLflow copies the model's code file with the
    # checkout's mode), and the stores, crops and the model themselves
    seen = stranger.probe(*made)
    assert set(seen.values()) == {"denied"}, {path: got for path, got in seen.items() if got != "denied"}
    stores = [open_folder / "mlflow.db", open_folder / "runs", open_folder / "processed"]
    stores += [path for path in made if path.suffix in (".jpg", ".pt", ".csv", ".ckpt") or path.name == "mlflow.db"]
    assert not [path for path in stores if path.stat().st_mode & 0o077]
    assert stranger.probe(open_raw)[str(open_raw)].startswith("listed")  # the probe itself sees what it may


def test_fold_jobs_get_the_runs_own_user_and_no_password_leaks(tiny_config, tmp_path, stranger,
                                                               monkeypatch) -> None:
    """The parallel launcher's private server over the store, with a driver whose environment holds an admin's
    password and a database password: the other account gets 401 from the loopback server and cannot read its
    environment or the jobs'; the server's command line names no store and no password; the fold job gets the user
    made for the run (not an admin) and none of the driver's secrets; the store URI the fold run tags, given as a
    postgres URI with a password, is in no tag, job file or log line but redacted."""
    db_password, admin_password = secrets.token_urlsafe(12), secrets.token_urlsafe(12)
    store_uri = f"postgresql://painvit:{db_password}@db.invalid:5432/mlflow"
    monkeypatch.setenv(ADMIN_PASSWORD_ENV, admin_password)  # a `make server` admin's, as the README exported it
    monkeypatch.setenv(USERNAME_ENV, "admin")
    monkeypatch.setenv(PASSWORD_ENV, admin_password)
    monkeypatch.setenv("PGPASSWORD", db_password)
    monkeypatch.setenv("PYTHONPATH", str(PROJECT_ROOT))
    cfg = tiny_config(*ONE_FOLD, "cv.log_models=false", "launcher=parallel", "launcher.jobs=1",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                      f"mlflow.artifact_root={tmp_path / 'mlartifacts'}", f"cv.work_dir={tmp_path / 'runs'}")
    uri = cfg.mlflow.tracking_uri
    client = MlflowClient(uri)
    plan = plan_cv(CvRunSettings.from_config(cfg), client, uri)
    artifact_root = client.get_experiment(plan.experiment_id).artifact_location
    seen: dict = {}

    with private_server.tracking_server(uri, artifact_root, experiment_ids=[plan.experiment_id]) as server:
        def report(fold: int, state: str, detail) -> None:
            if state != "running":
                return
            pid = int(detail.split()[1].rstrip(","))  # "pid <n>, log <path>"
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            seen["job_env"] = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
            seen["stranger"] = stranger.probe(
                f"{server.uri}/api/2.0/mlflow/experiments/search?max_results=1", f"/proc/{pid}/environ",
                f"/proc/{server.process.pid}/environ")

        group = [pid for pid in os.listdir("/proc") if pid.isdigit() and _process_group(pid) == server.process.pid]
        command_lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group]
        job = replace(plan.job(0, server.uri), store_uri=store_uri)  # the store the run tags: postgres, password
        outcome = launchers.launch_parallel(
            [job], 1, report, lambda fold: result_from_run(
                client, tracking.finished_fold_runs(client, plan.parent_run_id)[fold]), server.credentials)
        run_user, run_password = server.credentials[USERNAME_ENV], server.credentials[PASSWORD_ENV]
        status, _ = auth_call(server.uri, "/api/2.0/mlflow/users/create", run_user, run_password,
                              {"username": "intruder", "password": "x"})
        assert status == 403  # the jobs' user is no admin: it cannot make users
        admin = server.admin

    assert outcome.done == [0], outcome.failed
    assert group and all(b"mlflow" in line for line in command_lines)
    for line in command_lines:  # `ps` shows neither the store nor any password
        for secret in (admin[1], run_password, str(tmp_path), db_password):
            assert secret.encode() not in line, line
    env = seen["job_env"]
    assert env[USERNAME_ENV] == run_user != admin[0] and env[PASSWORD_ENV] == run_password
    assert not {ADMIN_PASSWORD_ENV, "PGPASSWORD"} & set(env) and admin_password not in "".join(env.values())
    probe = seen["stranger"]
    assert list(probe.values()) == [401, "denied", "denied"], probe
    (child,) = tracking.fold_runs(client, plan.parent_run_id)
    assert child.data.tags[tracking.JOB_TRACKING_URI_TAG] == "postgresql://painvit:***@db.invalid:5432/mlflow"
    job_file = plan.work_dir / "fold_0.json"
    assert json.loads(job_file.read_text())["store_uri"] == child.data.tags[tracking.JOB_TRACKING_URI_TAG]
    assert (plan.work_dir / "fold_0.log").is_file()
    for path in tmp_path.rglob("*"):  # the store, the artifacts, the job file, the fold's log and checkpoints
        if path.is_file():
            data = path.read_bytes()
            for secret in (db_password, admin_password, admin[1], run_password):
                assert secret.encode() not in data, path


def _process_group(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def test_slurm_tasks_get_the_runs_credentials_alone_from_a_private_folder(tiny_config, tmp_path,
                                                                          monkeypatch) -> None:
    """SLURM hands the submitter's environment to its tasks: what `sbatch` sees (a stand-in on PATH that records its
    environment; submitit is the real one) holds the run's credentials and none of the driver's secrets, and the
    driver's own environment is back after. submitit's folder, whose pickles the nodes unpickle, is made 0700 even
    where it existed open."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "sbatch.env"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\nenv > {seen}\necho Submitted batch job 4242\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit asks that SLURM is there; never run here
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    admin_password, db_password = secrets.token_urlsafe(12), secrets.token_urlsafe(12)
    for variable, value in ((ADMIN_PASSWORD_ENV, admin_password), (USERNAME_ENV, "admin"),
                            (PASSWORD_ENV, admin_password), ("PGPASSWORD", db_password)):
        monkeypatch.setenv(variable, value)
    folder = tmp_path / "runs" / "parent" / "slurm"
    folder.mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)
    cfg = tiny_config("launcher=slurm")
    job = FoldJob({}, 0, "parent", "http://127.0.0.1:5000", str(tmp_path / "fold_0"), decisions=None,  # type: ignore[arg-type]
                  store_uri="http://127.0.0.1:5000")
    run_user = {USERNAME_ENV: "painvit-jobs-0000", PASSWORD_ENV: "the run's own"}
    launcher = launchers.LauncherSettings.of(cfg.launcher)
    assert launchers.submit_slurm([job], launcher, folder, "privacy", run_user) == {0: "4242"}  # one task: no array
    env = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
    assert env[USERNAME_ENV] == "painvit-jobs-0000" and env[PASSWORD_ENV] == "the run's own"
    assert not {ADMIN_PASSWORD_ENV, "PGPASSWORD"} & set(env)
    assert admin_password not in seen.read_text() and db_password not in seen.read_text()
    assert os.environ[ADMIN_PASSWORD_ENV] == admin_password and os.environ[PASSWORD_ENV] == admin_password
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and list(folder.glob("*.pkl"))
