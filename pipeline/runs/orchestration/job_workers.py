"""The parallel launcher's workers: one long-lived process per slot (a GPU, or a share of the cores), fed one job after
another, so that imports (torch, Lightning, MLflow: about 8 s) and what a job reads once per process (an embedding
cache entry) are paid once per worker, not once per job. Short jobs (a cached probe's LOSO fold: 1-2 s, a power
study's folds) then keep every slot busy.

A worker (`python -m pipeline job-worker <fd>`) gets its slot's environment and CPU affinity and the credentials made
for the run when it starts, and the jobs over a private socket (pickled, as submitit ships them to SLURM); it runs each
in its own process as the local launcher does (`job.run()`: a fold job's lease, heartbeat, exact resume and sealing are
the same), its output into the job's log, and answers what became of it. A job that fails is the job's failure: the
worker goes on with the next. A worker that dies (killed, out of memory) fails the job it ran and is replaced. A job
that finds the tracking server gone for good (`unreachable`) ends its worker and the launch. Ctrl-C (SIGINT) reaches
every worker: a running fold marks its run KILLED.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from pipeline.runs.store.private_server import log_tail
from pipeline.runs.store.unreachable import EXIT_UNREACHABLE, StoreUnreachable, is_unreachable, unreachable_line
from pipeline.utils.logging_setup import setup_logging
from pipeline.utils.processes import die_with_parent, interrupt_on

TOOL = "job-worker"  # `python -m pipeline job-worker <fd>`
DONE, FAILED, UNREACHABLE = "done", "failed", "unreachable"


@dataclass
class Worker:
    """The driver's handle on one worker: its process, its end of the socket, its slot and the job it runs now."""

    slot: int
    process: subprocess.Popen
    connection: Connection
    job: Any = None  # a launchers.Job while it runs one

    @property
    def busy(self) -> bool:
        return self.job is not None


def start_worker(slot: int, environment: Mapping[str, str], log_path: Path) -> Worker:
    """A worker in `slot` with `environment` (its slot's GPU or cores and the run's credentials, nothing else secret),
    pinned to its cores, dying with this process; its own output (between jobs) to `log_path`."""
    cpus = [int(c) for c in environment.get("PAINVIT_CPUS", "").split(",") if c]
    mine, theirs = socket.socketpair()

    def prepare_child() -> None:
        if sys.platform == "linux":
            die_with_parent()
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "pipeline", TOOL, str(theirs.fileno())],
                                   env=dict(environment), stdout=log_file, stderr=subprocess.STDOUT,
                                   pass_fds=[theirs.fileno()], preexec_fn=prepare_child)
    theirs.close()
    return Worker(slot, process, Connection(mine.detach()))


class WorkerPool:
    """The workers of one launch, or of every launch of one command (`launchers.LaunchSession`: the CVs of `make
    table` or `make power`), one per environment (slot), each started when its slot first takes a job and kept
    until `close`: a later launch's jobs go to the same processes, their imports paid. A worker that died meanwhile
    is replaced when its slot takes its next job."""

    def __init__(self, environments: Sequence[Mapping[str, str]]) -> None:
        self.environments = list(environments)
        self.workers: dict[int, Worker] = {}

    def run(self, jobs: Sequence[Any], report: Callable[[int, str, Any], None], result_of: Callable[[int], Any],
            outcome: Any) -> None:
        """Every job on the workers, at most one job each at a time: `report`s each job's states, fills `outcome`
        (done: its worker said so and `result_of(key)` is not None; failed: with the reason and its log's tail).
        StoreUnreachable once a job found the tracking server gone for good. On any error (Ctrl-C included) every
        worker is stopped (`close`): a running fold marks its run KILLED."""
        queue = list(jobs)
        for job in queue:
            report(job.key, "pending", None)
        try:
            while queue or any(worker.busy for worker in self.workers.values()):
                for slot in range(len(self.environments)):  # an idle slot takes the next job
                    if not queue:
                        break
                    worker = self.workers.get(slot)
                    if worker is not None and worker.busy:
                        continue
                    if worker is None or worker.process.poll() is not None:
                        worker = self.start(slot, queue[0].file("log").with_name(f"job_worker_{slot}.log"))
                    give(worker, queue.pop(0), report)
                busy = {worker.connection: worker for worker in self.workers.values() if worker.busy}
                for connection in wait(list(busy), timeout=1.0):  # an answer, or the end of a worker that died
                    settle(busy[connection], report, result_of, outcome)
        except BaseException:
            self.close()
            raise

    def start(self, slot: int, log_path: Path) -> Worker:
        """A new worker in `slot` (in place of one that ended)."""
        ended = self.workers.pop(slot, None)
        if ended is not None:
            ended.connection.close()
        self.workers[slot] = start_worker(slot, self.environments[slot], log_path)
        return self.workers[slot]

    def close(self) -> None:
        """Every worker stopped (`stop_workers`)."""
        workers, self.workers = list(self.workers.values()), {}
        stop_workers(workers)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def give(worker: Worker, job: Any, report: Callable[[int, str, Any], None]) -> None:
    """Send `job` to `worker` (its spec written beside its log, as a record: `python -m pipeline <tool> <spec>` runs
    it again by hand)."""
    job.write(job.file("json"))
    worker.connection.send_bytes(pickle.dumps({"job": job, "log": str(job.file("log"))}))
    worker.job = job
    report(job.key, "running", f"pid {worker.process.pid}, log {job.file('log')}")


def settle(worker: Worker, report: Callable[[int, str, Any], None], result_of: Callable[[int], Any],
           outcome: Any) -> None:
    """What `worker` answered about its job, into `outcome` and `report`."""
    job = worker.job
    try:
        state, detail = worker.connection.recv()
    except (EOFError, OSError):
        worker.process.wait()
        fail(worker, f"its worker (pid {worker.process.pid}) exited with code {worker.process.returncode}", report,
             outcome)
        return
    worker.job = None
    if state == UNREACHABLE:
        raise StoreUnreachable(f"job {job.key} found the tracking server gone ({detail})")
    result = result_of(job.key) if state == DONE else None
    if result is not None:
        outcome.done.append(job.key)
        report(job.key, "done", result)
        return
    worker.job = job
    fail(worker, detail or "it ended without a result", report, outcome)


def fail(worker: Worker, reason: str, report: Callable[[int, str, Any], None], outcome: Any) -> None:
    job, worker.job = worker.job, None
    log_path = job.file("log")
    outcome.failed[job.key] = f"{reason}, log {log_path}:\n{log_tail(log_path)}"
    report(job.key, "failed", outcome.failed[job.key])


def stop_workers(workers: Sequence[Worker], grace_s: float = 30) -> None:
    """Idle workers are told to end (their socket closed); busy ones (Ctrl-C, an error here) get SIGINT, so that a
    running fold marks its run KILLED; whatever has not ended after `grace_s` is killed."""
    for worker in workers:
        if worker.busy and worker.process.poll() is None:
            worker.process.send_signal(signal.SIGINT)
        worker.connection.close()
    for worker in workers:
        try:
            worker.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait(timeout=10)


@contextlib.contextmanager
def job_output(log_path: Path) -> Iterator[None]:
    """This process's stdout and stderr (Python's and the C level's) appended to `log_path` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as log_file:
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run_one(job: Any, log_path: Path) -> tuple[str, str]:
    """Run `job` here, its output in its log: (DONE, ""), (FAILED, why) or (UNREACHABLE, the line said)."""
    with job_output(log_path):
        try:
            job.run()
        except Exception as error:  # noqa: BLE001 - the job's failure: its log has the traceback, the worker goes on
            if is_unreachable(error):
                line = unreachable_line(getattr(job, "tracking_uri", ""), job.name)
                print(line, file=sys.stderr, flush=True)
                return UNREACHABLE, line
            traceback.print_exc()
            return FAILED, f"{type(error).__name__}: {error}"
    return DONE, ""


def worker_main(argv: list[str]) -> int:
    """`python -m pipeline job-worker <fd>`: run the jobs that come over the socket `fd`, one after the other, until
    it closes; the answer to each is (state, detail)."""
    setup_logging()
    interrupt_on(signal.SIGINT)  # the driver stops a busy worker with it (`stop_workers`), whatever was inherited
    connection = Connection(int(argv[0]))
    while True:
        try:
            message = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):  # the driver is done with this worker
            return 0
        except KeyboardInterrupt:  # Ctrl-C between jobs: nothing to stop
            return 130
        state, detail = run_one(message["job"], Path(message["log"]))
        connection.send((state, detail))
        if state == UNREACHABLE:
            return EXIT_UNREACHABLE
