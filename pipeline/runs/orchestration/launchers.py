"""Where fold jobs run: `local` (one after the other in this process), `parallel` (several processes on this
machine, one GPU or a share of the cores each) and `slurm` (one array task per fold through submitit).

Every launcher takes the same `FoldJob`s and reports fold state changes through one callback, so the driver
prints the same lines whatever runs the folds. Fold jobs write to MLflow themselves; with several writers that
must be a tracking server, never one sqlite file shared between processes: the parallel launcher puts a private
server in front of any database store (`tracking_server`: basic authentication on loopback too, the jobs' own user).
A fold job's environment holds no credential but the ones made for its run (`job_environment`), on SLURM too.
"""

from __future__ import annotations

import contextlib
import json
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from pipeline.runs.jobs.fold_job import FoldJob, FoldResult
from pipeline.runs.jobs.fold_run import run_fold_job
from pipeline.runs.store.tracking import open_store, redact_uri, uri_has_credentials
from pipeline.runs.store.tracking_server import (
    ADMIN_PASSWORD_ENV,
    ADMIN_USERNAME_ENV,
    ARTIFACT_ROOT_ENV,
    BACKEND_STORE_ENV,
    PASSWORD_ENV,
    USERNAME_ENV,
    make_run_user,
    private_server_environment,
    tracking_access_problem,
    without_credentials,
)
from pipeline.utils.cpus import available_cpus
from pipeline.utils.permissions import PRIVATE_UMASK

log = logging.getLogger(__name__)
LAUNCHERS = ("local", "parallel", "slurm")

# report(fold, state, detail): state is one of pending | running | done | failed
Report = Callable[[int, str, "FoldResult | str | None"], None]


class LauncherError(SystemExit):
    """A launcher that cannot run here, with a message that says what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


@dataclass
class LaunchOutcome:
    done: list[int] = field(default_factory=list)
    # fold (or "fold (seed s)" over several training seeds) -> reason / SLURM job id (launcher.wait=false)
    failed: dict[int | str, str] = field(default_factory=dict)
    submitted: dict[int | str, str] = field(default_factory=dict)


def check_launcher(launcher: DictConfig, tracking_uri: str) -> None:
    """Refuse, before any work, a launcher that cannot run here."""
    if launcher.name not in LAUNCHERS:
        raise LauncherError(f"unknown launcher {launcher.name!r}; known: {', '.join(LAUNCHERS)}")
    if tracking_uri.startswith(("http://", "https://")) and uri_has_credentials(tracking_uri):  # into job files
        raise LauncherError(f"the tracking URI carries a user or password; it is written into job files and run tags. "
                            f"Use {USERNAME_ENV} and {PASSWORD_ENV} (MLflow reads them) and a URI without them")
    if launcher.name != "slurm":
        return
    if shutil.which("sbatch") is None:
        raise LauncherError("LAUNCHER=slurm needs SLURM's `sbatch` on PATH, and it is not there. Run `make cv` on a "
                            "login node of the cluster, or use LAUNCHER=parallel on this machine.")
    if not tracking_uri.startswith(("http://", "https://")):
        raise LauncherError(
            f"LAUNCHER=slurm needs an MLflow tracking server that the compute nodes reach, but the tracking URI is "
            f"{redact_uri(tracking_uri)!r}: a sqlite file must not be written by several nodes (and is unsafe on "
            f"NFS). Start one on the login node, e.g. `make server SERVER_HOST=0.0.0.0 "
            f"SERVER_STORE=postgresql://...` (docs/scale-out.md, a tracking server), then "
            f"`export MLFLOW_TRACKING_URI=http://<login-node>:5000` and run `make cv` again.")
    problem = tracking_access_problem(tracking_uri)
    if problem:
        raise LauncherError(f"LAUNCHER=slurm: {problem}")


# ---------------------------------------------------------------------------------------------------------------
# local

def launch_local(jobs: list[FoldJob], report: Report) -> LaunchOutcome:
    """Folds one after the other in this process; a failed fold is reported and the others go on."""
    outcome = LaunchOutcome()
    for job in jobs:
        report(job.fold, "running", None)
        try:
            result = run_fold_job(job)
        except Exception as error:  # noqa: BLE001 - the fold's run holds the traceback; the others go on
            outcome.failed[job.fold] = f"{type(error).__name__}: {error}"
            report(job.fold, "failed", outcome.failed[job.fold])
            continue
        outcome.done.append(job.fold)
        report(job.fold, "done", result)
    return outcome


# ---------------------------------------------------------------------------------------------------------------
# parallel

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In a child process (Linux): receive SIGTERM when the launching process dies, even by kill -9."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _private_child() -> None:
    """In a server started here: what it creates (a new sqlite store, its journal, artifacts) is this user's alone,
    whatever umask the caller had; and it dies with its parent (Linux)."""
    os.umask(PRIVATE_UMASK)
    if sys.platform == "linux":
        _die_with_parent()


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
    env = {**without_credentials(os.environ), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
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
                                   f"{_log_tail(server_log, 30)}")
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


def visible_gpus() -> list[str]:
    """The GPU ids this process may use (CUDA_VISIBLE_DEVICES if set, else every device torch sees)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu for gpu in visible.split(",") if gpu.strip() and gpu.strip() != "-1"]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def job_slots(n_jobs: int | None, gpus: list[str], cpus: list[int]) -> list[dict[str, str]]:
    """One environment per concurrent job: its own GPU, or on a CPU an equal share of the cores.

    Default: one job per GPU, else 1. On a CPU each job gets len(cpus) // n_jobs cores as its torch threads,
    dataloader workers (the loader's automatic count follows the affinity mask) and affinity mask.
    """
    n_jobs = n_jobs or max(1, len(gpus))
    if gpus:
        if n_jobs > len(gpus):
            raise LauncherError(f"launcher.jobs={n_jobs} but only {len(gpus)} GPU(s) are visible ({gpus}): one job "
                                f"per GPU")
        return [{"CUDA_VISIBLE_DEVICES": gpus[slot]} for slot in range(n_jobs)]
    share = max(1, len(cpus) // n_jobs)
    slots = []
    for slot in range(n_jobs):
        mine = cpus[slot * share:(slot + 1) * share] or cpus[-share:]
        threads = str(len(mine))
        slots.append({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                      "PAINVIT_CPUS": ",".join(map(str, mine))})
    return slots


def job_environment(slot: Mapping[str, str], credentials: Mapping[str, str],
                    environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A fold job's (or search worker's) environment: this one less every credential (an admin's password, a
    database password, the driver's tracking credentials), plus its slot (GPU, cores) and the credentials made for
    its run."""
    return {**without_credentials(os.environ if environ is None else environ), **slot, **credentials}


def _start_job(job: FoldJob, slot: dict[str, str],
               credentials: Mapping[str, str]) -> tuple[subprocess.Popen, Path]:
    work_dir = Path(job.work_dir)
    spec = job.write(work_dir.parent / f"fold_{job.fold}.json")
    log_path = work_dir.parent / f"fold_{job.fold}.log"
    cpus = [int(c) for c in slot.get("PAINVIT_CPUS", "").split(",") if c]

    def prepare_child() -> None:
        if sys.platform == "linux":
            _die_with_parent()
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    with open(log_path, "ab") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "pipeline", "fold-job", str(spec)],
                                   env=job_environment(slot, credentials), stdout=log_file,
                                   stderr=subprocess.STDOUT, preexec_fn=prepare_child)
    return process, log_path


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def launch_parallel(jobs: list[FoldJob], n_jobs: int | None, report: Report,
                    result_of: Callable[[int], FoldResult | None],
                    credentials: Mapping[str, str] | None = None) -> LaunchOutcome:
    """Up to n_jobs fold processes at once (`python -m pipeline fold-job <job.json>`), each in its own slot, with
    `credentials` (the tracking server's user for the run) as their only secret."""
    slots = job_slots(n_jobs, visible_gpus(), sorted(_cpu_ids()))
    queue, running, outcome = list(jobs), {}, LaunchOutcome()
    for job in queue:
        report(job.fold, "pending", None)
    free = list(range(len(slots)))
    try:
        while queue or running:
            while queue and free:
                job, slot = queue.pop(0), free.pop(0)
                process, log_path = _start_job(job, slots[slot], credentials or {})
                running[job.fold] = (process, slot, log_path)
                report(job.fold, "running", f"pid {process.pid}, log {log_path}")
            time.sleep(0.5)
            for fold, (process, slot, log_path) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[fold]
                free.append(slot)
                result = result_of(fold) if process.returncode == 0 else None
                if result is not None:
                    outcome.done.append(fold)
                    report(fold, "done", result)
                else:
                    outcome.failed[fold] = f"exit code {process.returncode}, log {log_path}:\n{_log_tail(log_path)}"
                    report(fold, "failed", outcome.failed[fold])
    finally:  # Ctrl-C or an error in the driver: stop the jobs (SIGINT lets each mark its run KILLED)
        for process, _, _ in running.values():
            process.send_signal(signal.SIGINT)
        for process, _, _ in running.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    return outcome


def _cpu_ids() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(available_cpus()))


# ---------------------------------------------------------------------------------------------------------------
# slurm

class SlurmFoldTask:
    """The callable submitit runs on a node. On preemption or time-out submitit calls `checkpoint`, which requeues
    the same task: the fold then continues from its last epoch checkpoint (its work folder is on shared disk)."""

    def __init__(self, job: FoldJob) -> None:
        self.job = job

    def __call__(self) -> dict[str, float]:
        from pipeline.utils.logging_setup import setup_logging

        setup_logging()
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        if cpus:  # clusters without CPU cgroups show every core to every task: keep to the cores asked for
            import torch

            torch.set_num_threads(int(cpus))
        return run_fold_job(self.job).metrics

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(SlurmFoldTask(self.job))


def slurm_executor(launcher: DictConfig, folder: Path, name: str):
    """A submitit executor with every site-specific setting taken from `configs/launcher/slurm.yaml`."""
    import submitit

    # submitit's pickles there are unpickled on the node: anyone who could write there would run code as this user
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    parameters = {"timeout_min": launcher.time_min, "cpus_per_task": launcher.cpus_per_task,
                  "tasks_per_node": 1, "nodes": 1, "name": name,
                  "slurm_array_parallelism": launcher.array_parallelism,
                  "slurm_setup": list(launcher.setup or [])}
    if launcher.mem_gb is not None:
        parameters["mem_gb"] = launcher.mem_gb
    if launcher.gpus_per_task:
        parameters["gpus_per_node"] = launcher.gpus_per_task
    optional = {"slurm_partition": launcher.partition, "slurm_account": launcher.account,
                "slurm_qos": launcher.qos}
    parameters.update({k: v for k, v in optional.items() if v})
    if launcher.additional:
        parameters["slurm_additional_parameters"] = dict(launcher.additional)
    executor.update_parameters(**parameters)
    return executor


@contextlib.contextmanager
def submission_environment(credentials: Mapping[str, str]) -> Iterator[None]:
    """os.environ as the SLURM tasks are to get it, for as long as the block submits them (sbatch hands the
    submitter's environment to its tasks): `job_environment`'s, then restored."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(job_environment({}, credentials, saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def submit_slurm(jobs: list[FoldJob], launcher: DictConfig, folder: Path, name: str,
                 credentials: Mapping[str, str] | None = None) -> dict[int, str]:
    """Submit the folds as one SLURM array, with `credentials` as the tasks' only secret; returns fold -> SLURM job
    id (`<array>_<task>`)."""
    executor = slurm_executor(launcher, folder, name)
    with submission_environment(credentials or {}), executor.batch():
        submitted = [executor.submit(SlurmFoldTask(job)) for job in jobs]
    return {job.fold: str(handle.job_id) for job, handle in zip(jobs, submitted, strict=True)}


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM state of each job still known to the scheduler (PENDING, RUNNING, ...); finished jobs are absent.

    squeue, not sacct: sacct needs accounting, which many small clusters (and this project's test cluster) lack.
    """
    arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
    if not arrays:
        return {}
    result = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(arrays), "-o", "%i %T"], capture_output=True,
                            text=True)
    states = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def wait_slurm(job_ids: dict[int, str], report: Report, fold_status: Callable[[int], str],
               result_of: Callable[[int], FoldResult | None], poll_s: float) -> LaunchOutcome:
    """Follow submitted folds until each has left the queue; fold outcome from its MLflow child run."""
    outcome, pending = LaunchOutcome(), dict(job_ids)
    last_state: dict[int, str] = {}
    while pending:
        states = slurm_states(list(pending.values()))
        for fold, job_id in list(pending.items()):
            state = states.get(job_id)
            if state is not None:
                shown = "running" if state in ("RUNNING", "COMPLETING", "CONFIGURING") else "pending"
                if last_state.get(fold) != shown:
                    last_state[fold] = shown
                    report(fold, shown, f"SLURM job {job_id} {state}")
                continue
            del pending[fold]
            result = result_of(fold) if fold_status(fold) == "FINISHED" else None
            if result is not None:
                outcome.done.append(fold)
                report(fold, "done", result)
            else:
                outcome.failed[fold] = f"SLURM job {job_id} ended without a finished run (see its log in the " \
                                       f"submitit folder, `{job_id}_0_log.err`)"
                report(fold, "failed", outcome.failed[fold])
        if pending:
            time.sleep(poll_s)
    return outcome


def job_ids_tag(job_ids: dict[int, str]) -> str:
    return json.dumps({str(fold): job_id for fold, job_id in job_ids.items()})


def stop_process_group(process: subprocess.Popen, grace_s: float = 30) -> None:
    """End a process started in its own session (`start_new_session=True`) and everything it started: SIGTERM to
    the group, SIGKILL after `grace_s` seconds; gone already is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
