"""One fold trained once, whichever machine asks: a lease on each fold attempt, held in the tracking store.

Two drivers that start the same new CV at once each create a parent run; `first_of_twins`, asked by both once
theirs is written, keeps the one that started first and deletes the other, so both train into one CV.

The file lock of `make cv` (`identity_lock`) keeps two drivers on one machine apart; two login nodes sharing one
tracking server are kept apart here, through the store every node reaches:

- **Taken atomically.** Attempt n of a fold is claimed by logging the parameter
  `painvit.lease.fold_<k>[.seed_<s>].attempt_<n>` = "<owner> <unix time>" on the CV's parent run. MLflow parameters
  cannot change once logged: the store's primary key lets exactly one claimant write it, and every other one gets an
  error and reads who holds it.
- **Held by a heartbeat.** The winner's child run carries `painvit.lease` (its owner: host, pid, a random part) and
  `painvit.heartbeat` (unix seconds), renewed every `lease_s / 5` by a thread for as long as the fold trains.
- **Waited for, or taken over.** A job that finds its fold RUNNING under a heartbeat younger than `cv.lease_s` waits
  for it and returns its result when it finishes; a RUNNING attempt whose heartbeat is older (its node lost power, its
  job was killed), one of this machine whose process is gone, or this SLURM task's own before its requeue, is marked
  KILLED and the next attempt is claimed, as a killed run was before.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from pipeline.runs.tracking import HOST_TAG, PID_TAG, SLURM_JOB_TAG

log = logging.getLogger(__name__)
LEASE_TAG = "painvit.lease"  # on a fold's child run: the owner of its lease
HEARTBEAT_TAG = "painvit.heartbeat"  # on a fold's child run: unix seconds of the last renewal
LEASE_PARAM = "painvit.lease"  # prefix of the parent run's claim parameters


def first_of_twins(client: MlflowClient, experiment_id: str, tags: dict[str, str], created: Run,
                   window_s: float = 120.0) -> Run:
    """The parent run a new CV goes on with: `created`, unless another driver created a RUNNING parent with the same
    identity `tags` at most `window_s` earlier, or one that started first since (start time, then run id: every driver
    picks the same one); then `created` is deleted and that one returned, and its folds are shared through the leases.
    An older RUNNING parent is a killed CV, not a twin: `make cv` resumes those before it creates one."""
    since = created.info.start_time - int(window_s * 1000)
    query = " and ".join([f"tags.`{key}` = '{value}'" for key, value in tags.items()]
                         + ["attributes.status = 'RUNNING'", f"attributes.start_time >= {since}"])
    twins = client.search_runs([experiment_id], query, max_results=100)
    first = min([*twins, created], key=lambda run: (run.info.start_time, run.info.run_id))
    if first.info.run_id == created.info.run_id:
        return created
    client.delete_run(created.info.run_id)
    print(f"the same cross-validation was started elsewhere a moment ago: going on with its parent run "
          f"{first.info.run_id} (this one, {created.info.run_id}, deleted); its folds are shared", flush=True)
    return first


def new_owner() -> str:
    """Who holds a lease: host, process and a random part (a pid is reused across reboots and nodes)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def claim_key(fold: int, seed: int | None, attempt: int) -> str:
    return f"{LEASE_PARAM}.fold_{fold}" + (f".seed_{seed}" if seed is not None else "") + f".attempt_{attempt}"


def own_slurm_job() -> str | None:
    """This process's SLURM task as the fold runs record it (`<array>_<task>`, or the job id), None outside SLURM."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]


def heartbeat_age(run: Run, now: float | None = None) -> float:
    """Seconds since the run's last heartbeat; infinite for a run without one (older code, or never renewed)."""
    value = run.data.tags.get(HEARTBEAT_TAG)
    try:
        return (time.time() if now is None else now) - float(value) if value else float("inf")
    except ValueError:
        return float("inf")


def is_live(run: Run, lease_s: float) -> bool:
    """A RUNNING attempt whose heartbeat is younger than `lease_s`, unless it ran on this machine in a process that
    is gone (a killed job resumed here is taken over at once, not after `lease_s`)."""
    if run.info.status != "RUNNING" or heartbeat_age(run) >= lease_s:
        return False
    slurm_job = run.data.tags.get(SLURM_JOB_TAG)
    if slurm_job and slurm_job == own_slurm_job():  # this SLURM task's own earlier run: requeued after preemption
        return False
    pid = run.data.tags.get(PID_TAG, "")
    if run.data.tags.get(HOST_TAG) == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process of that number: alive
            return True
    return True


def claim(client: MlflowClient, parent_run_id: str, fold: int, seed: int | None, attempt: int, owner: str,
          lease_s: float) -> int | None:
    """Claim `attempt` (or a later one whose claimants never went on) for `owner`; the attempt won, or None when a
    live claim holds it."""
    failures = 0
    while True:
        key = claim_key(fold, seed, attempt)
        value = f"{owner} {time.time():.3f}"
        try:
            client.log_param(parent_run_id, key, value)
            return attempt
        except MlflowException:  # written already: by whom, and when?
            held = client.get_run(parent_run_id).data.params.get(key, "")
        if not held:  # the write failed without a claim there (a busy store): the same attempt again
            failures += 1
            if failures > 5:
                raise RuntimeError(f"cannot claim fold {fold}: the tracking store refuses the lease parameter {key}")
            time.sleep(0.2 * failures)
            continue
        holder, _, taken = held.partition(" ")
        if holder == owner:
            return attempt
        try:
            age = time.time() - float(taken)
        except ValueError:
            age = float("inf")
        if age < lease_s:
            return None
        attempt += 1  # a claim whose owner never started (or long stopped): the next attempt is free


class Heartbeat:
    """Renews `HEARTBEAT_TAG` on a run every `interval_s` from a thread, until stopped (a `with` block)."""

    def __init__(self, client: MlflowClient, run_id: str, interval_s: float) -> None:
        self.client, self.run_id, self.interval_s = client, run_id, interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.beat, name=f"heartbeat-{run_id[:8]}", daemon=True)

    def beat(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.client.set_tag(self.run_id, HEARTBEAT_TAG, f"{time.time():.3f}")
            except Exception as error:  # noqa: BLE001 - a server that is down a moment: the next beat retries
                log.warning("heartbeat of run %s not renewed: %s", self.run_id, error)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)


def lease_tags(owner: str) -> dict[str, str]:
    """The tags a new attempt's child run starts with: its owner and a first heartbeat."""
    return {LEASE_TAG: owner, HEARTBEAT_TAG: f"{time.time():.3f}"}


def acquire(client: MlflowClient, parent_run_id: str, fold: int, seed: int | None, owner: str, lease_s: float,
            list_attempts: Callable[[], list[Run]], poll_s: float | None = None) -> tuple[int, Run | None]:
    """Wait until this fold is either finished (returns (0, that run)) or claimed by `owner` (returns (attempt,
    None)); stale RUNNING attempts are marked KILLED before a claim. `list_attempts` gives the fold's runs, newest
    first."""
    poll_s = poll_s if poll_s is not None else min(10.0, max(lease_s / 10, 0.2))
    said = ""
    while True:
        previous = list_attempts()
        finished = [run for run in previous if run.info.status == "FINISHED"]
        if finished:
            return 0, finished[0]
        live = [run for run in previous if is_live(run, lease_s) and run.data.tags.get(LEASE_TAG) != owner]
        if not live:
            attempt = claim(client, parent_run_id, fold, seed, len(previous) + 1, owner, lease_s)
            if attempt is not None:
                for run in previous:
                    if run.info.status == "RUNNING":  # a dead attempt (no heartbeat for lease_s): this one replaces it
                        client.set_terminated(run.info.run_id, "KILLED")
                return attempt, None
        holder = live[0].data.tags.get(LEASE_TAG, "another job") if live else "another job (just claimed)"
        if holder != said:
            print(f"fold {fold}{'' if seed is None else f' (seed {seed})'} is being trained by {holder}; waiting for "
                  f"it (taken over if its heartbeat stops for {lease_s:g} s)", flush=True)
            said = holder
        time.sleep(poll_s)
