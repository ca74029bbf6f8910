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
  `painvit.heartbeat` (its unix seconds, a value that changes), renewed every `lease_s / 5` by a thread for as long as
  the fold trains.
- **Dead only when seen dead.** Another machine's clock is never compared with this one's: an observer (`Watch`)
  notes each attempt's heartbeat value and when, on its own `time.monotonic()`, it first saw it; an attempt is dead
  once that value has not changed for `cv.lease_s` of the observer's clock (a skewed clock on either side changes
  nothing). A claim parameter whose claimant never started its run is abandoned by the same rule.
- **Waited for, or taken over.** A job that finds its fold RUNNING under a live heartbeat waits for it and returns
  its result when it finishes; a dead attempt (its node lost power, its job was killed), one of this machine whose
  process is gone, or this SLURM task's own before its requeue, is marked KILLED and the next attempt is claimed. "This
  machine" is the host name, the boot id and the PID namespace together (`machine_identity`, the runs' host tag): two
  containers with one host name, or one node rebooted, are not this machine, and their attempts are watched instead.
- **Lost, and let go.** Each beat first reads the run back: a run that is no longer RUNNING, or whose lease tag names
  another owner, was taken over; the beat stops renewing, and `check` (a Lightning callback at every step, and the
  job before it marks the run FINISHED) raises `LeaseLost`, so a job that was taken over never finishes its run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from pipeline.runs.store.tracking import (
    FINISHED,
    HEARTBEAT_TAG,
    HOST_TAG,
    KILLED,
    LEASE_PARAM,
    LEASE_TAG,
    PID_TAG,
    RUNNING,
    SLURM_JOB_TAG,
)
from pipeline.runs.store.unreachable import is_unreachable

log = logging.getLogger(__name__)
# LEASE_TAG (on a fold's child run: the owner of its lease), HEARTBEAT_TAG (there: unix seconds of the last renewal)
# and LEASE_PARAM (prefix of the parent run's claim parameters) are the store's names (pipeline.runs.store.tracking)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # Linux: new at every boot
PID_NAMESPACE = Path("/proc/self/ns/pid")  # Linux: its inode names this process's PID namespace
UNKNOWN = "?"


class LeaseLost(RuntimeError):
    """This job's fold attempt was taken over by another job (its run is no longer RUNNING or no longer its)."""


def first_of_twins(client: MlflowClient, experiment_id: str, tags: dict[str, str], created: Run,
                   window_s: float = 120.0) -> Run:
    """The parent run a new CV goes on with: `created`, unless another driver created a RUNNING parent with the same
    identity `tags` at most `window_s` earlier, or one that started first since (start time, then run id: every driver
    picks the same one); then `created` is deleted and that one returned, and its folds are shared through the leases.
    An older RUNNING parent is a killed CV, not a twin: `make cv` resumes those before it creates one."""
    since = created.info.start_time - int(window_s * 1000)
    query = " and ".join([f"tags.`{key}` = '{value}'" for key, value in tags.items()]
                         + [f"attributes.status = '{RUNNING}'", f"attributes.start_time >= {since}"])
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


def machine_identity() -> str:
    """This machine as the fold runs' host tag records it: `<host name> boot=<boot id> pidns=<PID namespace inode>`.
    A process number means something only within one boot and one PID namespace; where /proc does not say (not
    Linux), that part is `?` and no attempt is ever judged by its process number."""
    try:
        boot = BOOT_ID.read_text().strip() or UNKNOWN
    except OSError:
        boot = UNKNOWN
    try:
        namespace = str(PID_NAMESPACE.stat().st_ino)
    except OSError:
        namespace = UNKNOWN
    return f"{socket.gethostname()} boot={boot} pidns={namespace}"


def on_this_machine(host_tag: str | None) -> bool:
    """Whether a process recorded under `host_tag` ran on this machine: host name, boot id and PID namespace all
    equal, and known. An older run's plain host name is never this machine: it is watched, not judged by its pid."""
    own = machine_identity()
    return bool(host_tag) and host_tag == own and UNKNOWN not in own.split(" ", 1)[1]


def process_gone(tags: dict[str, str]) -> bool:
    """Whether the attempt with these run tags ran here, in a process that no longer exists."""
    pid = tags.get(PID_TAG, "")
    if not (pid.isdigit() and on_this_machine(tags.get(HOST_TAG))):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that number: alive
        return False
    return False


class Watch:
    """One observer's view of other jobs' attempts: each heartbeat (and each claim) with the value it last had, the
    moment, on this process's monotonic clock, that value was first seen, and when it was last seen. Kept for as long
    as the observer waits, so that "unchanged for lease_s" is measured by one clock, its own.

    Time counts only while the observer sees the store: two sightings more than `lease_s / 2` apart (the tracking
    server was away, or this observer was) start the count again, since the owner could not renew its heartbeat in
    that gap either. An owner that beats every `lease_s / 5` is then never taken for dead across an outage: what
    was counted before a gap is at most `lease_s / 2`, and its next beat comes within `lease_s / 5` of the store's
    return."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.clock = lease_s, clock
        self.max_gap_s = lease_s / 2
        self.seen: dict[str, tuple[str, float, float]] = {}

    def unchanged_s(self, key: str, value: str) -> float:
        """Seconds of this observer's clock for which `key` has shown `value` without a gap in the sightings longer
        than `max_gap_s`; 0 when it is new, has changed or was out of sight that long."""
        now = self.clock()
        seen = self.seen.get(key)
        if seen is None or seen[0] != value or now - seen[2] > self.max_gap_s:
            self.seen[key] = (value, now, now)
            return 0.0
        self.seen[key] = (value, seen[1], now)
        return now - seen[1]

    def is_live(self, run: Run) -> bool:
        """A RUNNING attempt whose heartbeat this observer has not seen unchanged for `lease_s`, unless it is known
        dead at once: this SLURM task's own earlier run (requeued after preemption), or a run of this machine whose
        process is gone. A run without a heartbeat (older code) counts as one that never changes."""
        if run.info.status != RUNNING:
            return False
        slurm_job = run.data.tags.get(SLURM_JOB_TAG)
        if slurm_job and slurm_job == own_slurm_job():
            return False
        if process_gone(run.data.tags):
            return False
        return self.unchanged_s(run.info.run_id, run.data.tags.get(HEARTBEAT_TAG, "")) < self.lease_s

    def abandoned(self, key: str, value: str) -> bool:
        """A claim (immutable) that this observer has seen for `lease_s` with no run of its claimant live."""
        return self.unchanged_s(key, value) >= self.lease_s


def taken_over(run: Run, owner: str) -> str:
    """Why `owner` no longer holds `run`'s lease ("" while it does): the run is no longer RUNNING (another job marked
    it KILLED to take the fold over, or someone ended it), or its lease tag names another owner."""
    if run.info.status != RUNNING:
        return f"its run {run.info.run_id} is {run.info.status}: another job took the fold over"
    holder = run.data.tags.get(LEASE_TAG)
    if holder != owner:
        return f"its run {run.info.run_id} is held by {holder} now"
    return ""


def claim(client: MlflowClient, parent_run_id: str, fold: int, seed: int | None, attempt: int, owner: str,
          lease_s: float, watch: Watch | None = None) -> int | None:
    """Claim `attempt` (or a later one whose claimant never went on) for `owner`; the attempt won, or None when a
    claim that may still go on holds it. A claim is given up only once `watch` has seen it for `lease_s` (a fresh
    Watch, when none is given, has seen nothing yet); the time in its value is for people, never compared."""
    watch = watch or Watch(lease_s)
    failures = 0
    while True:
        key = claim_key(fold, seed, attempt)
        value = f"{owner} {time.time():.3f}"
        try:
            client.log_param(parent_run_id, key, value)
            return attempt
        except MlflowException:  # written already: by whom?
            held = client.get_run(parent_run_id).data.params.get(key, "")
        if not held:  # the write failed without a claim there (a busy store): the same attempt again
            failures += 1
            if failures > 5:
                raise RuntimeError(f"cannot claim fold {fold}: the tracking store refuses the lease parameter {key}")
            time.sleep(0.2 * failures)
            continue
        if held.partition(" ")[0] == owner:
            return attempt
        if not watch.abandoned(key, held):
            return None
        attempt += 1  # a claim whose owner never started (or long stopped): the next attempt is free


class Heartbeat:
    """Renews `HEARTBEAT_TAG` on `owner`'s run every `interval_s` from a thread, until stopped (a `with` block).

    Each beat first reads the run back: once it was taken over (`taken_over`), the beat stops renewing and records
    why in `lost`; `check` then raises `LeaseLost` in the thread that trains (a Lightning callback calls it at every
    step), and `confirm` reads the run once more before the job marks it FINISHED."""

    def __init__(self, client: MlflowClient, run_id: str, interval_s: float, owner: str) -> None:
        self.client, self.run_id, self.interval_s, self.owner = client, run_id, interval_s, owner
        self.lost = ""  # why this job no longer holds the run ("" while it does)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.beat, name=f"heartbeat-{run_id[:8]}", daemon=True)

    def beat(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.lost = taken_over(self.client.get_run(self.run_id), self.owner)
                if self.lost:
                    log.warning("lease lost: %s; this job stops at its next step without finishing the run",
                                self.lost)
                    return
                self.client.set_tag(self.run_id, HEARTBEAT_TAG, f"{time.time():.3f}")
            except Exception as error:  # noqa: BLE001 - a server that is down a moment: the next beat retries
                why = "the tracking server did not answer" if is_unreachable(error) else str(error)
                log.warning("heartbeat of run %s not renewed (%s); the next beat tries again", self.run_id, why)

    def check(self) -> None:
        """Raise `LeaseLost` once a beat has seen the run taken over."""
        if self.lost:
            raise LeaseLost(self.lost)

    def confirm(self) -> None:
        """Read the run now, not at the last beat: raise `LeaseLost` unless it is still this owner's and RUNNING."""
        self.lost = self.lost or taken_over(self.client.get_run(self.run_id), self.owner)
        self.check()

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
            list_attempts: Callable[[], list[Run]], poll_s: float | None = None,
            watch: Watch | None = None) -> tuple[int, Run | None]:
    """Wait until this fold is either finished (returns (0, that run)) or claimed by `owner` (returns (attempt,
    None)); dead RUNNING attempts are marked KILLED before a claim. `list_attempts` gives the fold's runs, newest
    first. `watch`: what this observer has seen so far (a job that waits again passes the same one)."""
    poll_s = poll_s if poll_s is not None else min(10.0, max(lease_s / 10, 0.2))
    watch = watch or Watch(lease_s)
    said = ""
    while True:
        previous = list_attempts()
        finished = [run for run in previous if run.info.status == FINISHED]
        if finished:
            return 0, finished[0]
        live = [run for run in previous if watch.is_live(run) and run.data.tags.get(LEASE_TAG) != owner]
        if not live:
            attempt = claim(client, parent_run_id, fold, seed, len(previous) + 1, owner, lease_s, watch)
            if attempt is not None:
                for run in previous:
                    if run.info.status == RUNNING:  # a dead attempt (seen unchanged for lease_s): replaced
                        client.set_terminated(run.info.run_id, KILLED)
                return attempt, None
        holder = live[0].data.tags.get(LEASE_TAG, "another job") if live else "another job (just claimed)"
        if holder != said:
            print(f"fold {fold}{'' if seed is None else f' (seed {seed})'} is being trained by {holder}; waiting for "
                  f"it (taken over once its heartbeat has not changed for {lease_s:g} s)", flush=True)
            said = holder
        time.sleep(poll_s)
