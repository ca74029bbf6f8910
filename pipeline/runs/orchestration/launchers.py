"""Where jobs run: `local` (one after the other in this process), `parallel` (several processes on this machine,
one GPU or a share of the cores each) and `slurm` (one array task per job through submitit).

A job follows `Job`: a CV's fold job (`FoldJob`, keyed by its fold) or a search worker (`search_workers.TuneWorker`,
keyed by its index); the CV (`cross_validation.launch_seed`) and the search (`search_workers.launch_workers`) use the
same launchers, which report state changes through one callback. Jobs write to MLflow themselves; with several
writers that must be a tracking server, never one sqlite file shared between processes: `job_store` decides for both
(a private server in front of any database store, `tracking_server`: basic authentication on loopback too, the jobs'
own user). A job's environment holds no credential but the ones made for its run (`job_environment`), on SLURM too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol

from mlflow import MlflowClient
from omegaconf import OmegaConf

from pipeline.runs.orchestration.job_workers import WorkerPool
from pipeline.runs.store.private_server import tracking_server
from pipeline.runs.store.tracking import redact_uri, uri_has_credentials
from pipeline.runs.store.tracking_server import (
    PASSWORD_ENV,
    USERNAME_ENV,
    job_credentials,
    tracking_access_problem,
    without_credentials,
)
from pipeline.runs.store.unreachable import is_unreachable
from pipeline.utils.cpus import available_cpus

log = logging.getLogger(__name__)
LAUNCHERS = ("local", "parallel", "slurm")

# report(key, state, detail): state is one of pending | running | done (detail: the job's result) | failed
Report = Callable[[int, str, Any], None]


@dataclass(frozen=True)
class LauncherSettings:
    """The `launcher` group (configs/launcher/<name>.yaml) as one value, read once by the command that launches:
    every launcher's name, `parallel`'s jobs, `slurm`'s site settings and whether to wait for its jobs. A key the
    launcher's file does not have is None."""

    name: str
    jobs: int | None  # parallel: processes at once (None: one per visible GPU, else 1)
    partition: str | None
    account: str | None
    qos: str | None
    gpus_per_task: int | None
    cpus_per_task: int | None
    mem_gb: int | None
    time_min: int | None
    array_parallelism: int | None
    setup: list[str] | None
    additional: dict | None
    wait: bool | None
    poll_s: float | None

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> LauncherSettings:
        values = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)
        return cls(**{item.name: values.get(item.name) for item in fields(cls)})


class Job(Protocol):
    """What a launcher runs, as plain values (pickled for submitit, JSON for a subprocess): `FoldJob`, `TuneWorker`.

    `key` names it in reports and outcomes (the fold; the worker's index), `name` in words (`fold 3`, `search worker
    0`); `tool` is the command that runs its spec in
    a process of its own (`python -m pipeline <tool> <spec.json>`); `file("json")` and `file("log")` are where that
    process's spec and output go; `write(path)` writes the spec (owner only, no password); `run()` runs the job in
    this process and returns its result."""

    tool: ClassVar[str]

    @property
    def key(self) -> int: ...

    @property
    def name(self) -> str: ...

    def file(self, kind: str) -> Path: ...

    def write(self, path: Path) -> Path: ...

    def run(self) -> Any: ...


class LauncherError(SystemExit):
    """A launcher that cannot run here, with a message that says what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


@dataclass
class LaunchOutcome:
    done: list[int] = field(default_factory=list)
    # job key (a CV's: fold, or "fold (seed s)" over several training seeds) -> reason / SLURM job id (wait=false)
    failed: dict[int | str, str] = field(default_factory=dict)
    submitted: dict[int | str, str] = field(default_factory=dict)


def check_launcher(name: str, tracking_uri: str) -> None:
    """Refuse, before any work, a launcher (`launcher.name`) that cannot run here."""
    if name not in LAUNCHERS:
        raise LauncherError(f"unknown launcher {name!r}; known: {', '.join(LAUNCHERS)}")
    if tracking_uri.startswith(("http://", "https://")) and uri_has_credentials(tracking_uri):  # into job files
        raise LauncherError(f"the tracking URI carries a user or password; it is written into job files and run tags. "
                            f"Use {USERNAME_ENV} and {PASSWORD_ENV} (MLflow reads them) and a URI without them")
    if name != "slurm":
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

def launch_local(jobs: Sequence[Job], report: Report) -> LaunchOutcome:
    """Jobs one after the other in this process (`job.run()`); a failed job is reported and the others go on."""
    outcome = LaunchOutcome()
    for job in jobs:
        report(job.key, "running", None)
        try:
            result = job.run()
        except Exception as error:  # noqa: BLE001 - a fold's run holds the traceback; the others go on
            if is_unreachable(error):  # the store's failure, not the job's: the others would wait for it too
                raise
            outcome.failed[job.key] = f"{type(error).__name__}: {error}"
            report(job.key, "failed", outcome.failed[job.key])
            continue
        outcome.done.append(job.key)
        report(job.key, "done", result)
    return outcome


@contextlib.contextmanager
def job_store(launcher: str, tracking_uri: str, client: MlflowClient, experiment_id: str,
              jobs: str = "fold jobs") -> Iterator[tuple[str, dict[str, str]]]:
    """(the tracking URI, the credentials) that the jobs of `launcher` get for `tracking_uri`, for as long as the
    block runs them: the one rule of the CV and the search. Several writers (`parallel`: processes beside this driver)
    over a database store: through a private server (`tracking_server`, a user of its own for them). Else the store
    itself: a tracking server (`slurm` needs one, `check_launcher`) with the credentials `job_credentials` makes for
    the run, or for `local` (this process writes) what this process uses, with none."""
    if launcher == "parallel" and not tracking_uri.startswith(("http://", "https://")):
        artifact_root = client.get_experiment(experiment_id).artifact_location
        with tracking_server(tracking_uri, artifact_root, experiment_ids=[experiment_id]) as server:
            print(f"MLflow server for the {jobs}: {server.uri} (over {redact_uri(tracking_uri)}, its own user for "
                  f"them)", flush=True)
            yield server.uri, server.credentials
        return
    yield tracking_uri, {} if launcher == "local" else job_credentials(tracking_uri, [experiment_id])


# ---------------------------------------------------------------------------------------------------------------
# parallel

def visible_gpus() -> list[str]:
    """The GPU ids this process may use (CUDA_VISIBLE_DEVICES if set, else every device torch sees)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu for gpu in visible.split(",") if gpu.strip() and gpu.strip() != "-1"]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def job_slots(n_jobs: int | None, gpus: list[str], cpus: list[int],
              max_threads: int | None = None) -> list[dict[str, str]]:
    """One environment per concurrent job: its own GPU, or on a CPU an equal share of the cores.

    Default: one job per GPU, else 1. On a CPU each job gets len(cpus) // n_jobs cores as its affinity mask and
    dataloader workers (the loader's automatic count follows the mask), and as many torch threads, at most
    `max_threads` (an OMP_NUM_THREADS the user set: fewer threads than cores were asked for).
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
        threads = str(min(len(mine), max_threads or len(mine)))
        slots.append({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                      "PAINVIT_CPUS": ",".join(map(str, mine))})
    return slots


def job_environment(slot: Mapping[str, str], credentials: Mapping[str, str],
                    environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A job's (a fold job's, a search worker's) environment: this one less every credential (an admin's password, a
    database password, the driver's tracking credentials), plus its slot (GPU, cores) and the credentials made for
    its run."""
    return {**without_credentials(os.environ if environ is None else environ), **slot, **credentials}


def parallel_environments(n_jobs: int | None, credentials: Mapping[str, str]) -> list[dict[str, str]]:
    """The parallel launcher's slots (`job_slots`: a GPU or a share of the cores each, at most the OMP_NUM_THREADS
    set here), each a job's environment with `credentials` (the tracking server's user for the run) as its only
    secret."""
    asked = os.environ.get("OMP_NUM_THREADS", "")
    slots = job_slots(n_jobs, visible_gpus(), sorted(_cpu_ids()), int(asked) if asked.isdigit() else None)
    return [job_environment(slot, credentials) for slot in slots]


def launch_parallel(jobs: Sequence[Job], n_jobs: int | None, report: Report, result_of: Callable[[int], Any],
                    credentials: Mapping[str, str] | None = None, pool: WorkerPool | None = None) -> LaunchOutcome:
    """The jobs on up to n_jobs long-lived worker processes (`job_workers`), one per slot (`parallel_environments`),
    each fed one job after another: those of `pool` (a `LaunchSession`'s, kept for the command's next launch), or
    workers started for these jobs and stopped after them. A job is done when its worker says so and
    `result_of(key)` is not None; else it failed, reported with its log's tail. Ctrl-C stops them."""
    outcome = LaunchOutcome()
    if pool is not None:
        pool.run(jobs, report, result_of, outcome)
        return outcome
    with WorkerPool(parallel_environments(n_jobs, credentials or {})) as own:
        own.run(jobs, report, result_of, outcome)
    return outcome


class LaunchSession:
    """What the CVs of one command share, each started by the first launch that needs it and stopped when the
    command ends (`with LaunchSession() as session`): where their jobs write (`job_store`: for the parallel launcher
    over a database store, a private tracking server) and the parallel launcher's workers (`WorkerPool`). `make
    table` runs five CVs and `make power` two a replicate, one after the other: each would otherwise pay a server's
    start (about 9 s) and every worker's imports (about 8 s) again, more than a fold of an in-memory probe costs.

    Between launches the server and the workers wait idle, while this process plans, aggregates and writes the
    store as it does without them (it is the only writer then). A launch for another launcher, store or experiment
    closes what is open and opens its own."""

    def __init__(self) -> None:
        self.key: tuple[str, str, str] | None = None  # (launcher, tracking URI, experiment) of what is open
        self.stack = contextlib.ExitStack()
        self.store: tuple[str, dict[str, str]] = ("", {})
        self.pool: WorkerPool | None = None
        self.pool_jobs: int | None = None

    def job_store(self, launcher: str, tracking_uri: str, client: MlflowClient, experiment_id: str,
                  jobs: str = "fold jobs") -> tuple[str, dict[str, str]]:
        """`job_store`'s (tracking URI, credentials) for the jobs, opened once for this launcher, store and
        experiment."""
        key = (launcher, tracking_uri, experiment_id)
        if key != self.key:
            self.close()
            self.store = self.stack.enter_context(job_store(launcher, tracking_uri, client, experiment_id, jobs))
            self.key = key
        return self.store

    def workers(self, n_jobs: int | None) -> WorkerPool:
        """The parallel launcher's workers for `n_jobs` slots, with the credentials of the open `job_store`; closed
        before its server stops."""
        if self.pool is None or self.pool_jobs != n_jobs:
            if self.pool is not None:
                self.pool.close()
            self.pool = WorkerPool(parallel_environments(n_jobs, self.store[1]))
            self.pool_jobs = n_jobs
            self.stack.callback(self.pool.close)
        return self.pool

    def close(self) -> None:
        """The workers stopped, then the server."""
        self.stack.close()
        self.key, self.store, self.pool, self.pool_jobs = None, ("", {}), None, None

    def __enter__(self) -> LaunchSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cpu_ids() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(available_cpus()))


# ---------------------------------------------------------------------------------------------------------------
# slurm

class SlurmTask:
    """The callable submitit runs on a node: one job (`job.run()`), its torch threads the cores SLURM gave it. On
    preemption or time-out submitit calls `checkpoint`, which requeues the same task: a fold then continues from its
    last epoch checkpoint, a search worker with the trials in the journal (both on shared disk)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __call__(self) -> Any:
        from pipeline.utils.logging_setup import setup_logging

        setup_logging()
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        if cpus:  # clusters without CPU cgroups show every core to every task: keep to the cores asked for
            import torch

            torch.set_num_threads(int(cpus))
        return self.job.run()

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(SlurmTask(self.job))


def slurm_executor(launcher: LauncherSettings, folder: Path, name: str):
    """A submitit executor with every site-specific setting taken from `configs/launcher/slurm.yaml`."""
    import submitit

    # submitit's pickles there are unpickled on the node: anyone who could write there would run code as this user
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    parameters: dict[str, Any] = {"timeout_min": launcher.time_min, "cpus_per_task": launcher.cpus_per_task,
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


def submit_slurm(jobs: Sequence[Job], launcher: LauncherSettings, folder: Path, name: str,
                 credentials: Mapping[str, str] | None = None) -> dict[int, str]:
    """Submit the jobs as one SLURM array (`SlurmTask`s), with `credentials` as the tasks' only secret; returns
    key -> SLURM job id (`<array>_<task>`)."""
    executor = slurm_executor(launcher, folder, name)
    with submission_environment(credentials or {}), executor.batch():
        submitted = [executor.submit(SlurmTask(job)) for job in jobs]
    return {job.key: str(handle.job_id) for job, handle in zip(jobs, submitted, strict=True)}


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


def wait_slurm(job_ids: dict[int, str], report: Report, result_of: Callable[[int], Any],
               poll_s: float) -> LaunchOutcome:
    """Follow submitted jobs (key -> SLURM job id) until each has left the queue; a job that left it is done when
    `result_of(key)` is not None (a fold: its FINISHED child run; a search worker: its result file), else failed."""
    outcome, pending = LaunchOutcome(), dict(job_ids)
    last_state: dict[int, str] = {}
    while pending:
        states = slurm_states(list(pending.values()))
        for key, job_id in list(pending.items()):
            state = states.get(job_id)
            if state is not None:
                shown = "running" if state in ("RUNNING", "COMPLETING", "CONFIGURING") else "pending"
                if last_state.get(key) != shown:
                    last_state[key] = shown
                    report(key, shown, f"SLURM job {job_id} {state}")
                continue
            del pending[key]
            result = result_of(key)
            if result is not None:
                outcome.done.append(key)
                report(key, "done", result)
            else:
                outcome.failed[key] = f"SLURM job {job_id} ended without a result (see its log in the submitit " \
                                      f"folder, `{job_id}_0_log.err`)"
                report(key, "failed", outcome.failed[key])
        if pending:
            time.sleep(poll_s)
    return outcome
