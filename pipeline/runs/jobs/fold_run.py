"""A fold job's child run: one fold of a cross-validation trained anywhere (this process, another process, a SLURM
node) under a run of its own, idempotently.

`run_fold_job` does not train a fold that already has a FINISHED child run; a child run left RUNNING by a killed
attempt is marked KILLED, and training continues from the fold's last epoch checkpoint when one exists. A lease in
the store (`fold_lease`) decides which job trains a fold: a fold another machine trains now is waited for, a dead
attempt replaced, and a job whose attempt was taken over stops and leaves it (`StopWhenLeaseLost`).

A fold run is marked FINISHED only once what the CV reads of it is safe (`pipeline.runs.jobs.sealing.seal_fold`), and
the run is still its own. The work folder then keeps only the local copies of what it stored, until the CV is
aggregated. A FINISHED run whose files have since gone from the store is not done (`sealing.retire_unreadable`): it is
marked FAILED with the reason and the fold trained again.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

import mlflow
import pandas as pd
import pytorch_lightning as pl
from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT as URL_PRINTING_OFF
from omegaconf import DictConfig, OmegaConf

from pipeline.runs.jobs.fold_decisions import settings_on_device
from pipeline.runs.jobs.fold_job import FoldJob, FoldResult, train_fold
from pipeline.runs.jobs.sealing import (
    FRAME_PREDICTIONS,
    VIDEO_PREDICTIONS,
    keep_only_artifacts,
    retire_unreadable,
    seal_fold,
)
from pipeline.runs.store import fold_lease
from pipeline.runs.store.run_record import RunRecord
from pipeline.runs.store.tracking import (
    ATTEMPT_TAG,
    FINISHED,
    FOLD_RUN,
    FOLD_TAG,
    HOST_TAG,
    JOB_TRACKING_URI_TAG,
    LEASE_LOST_TAG,
    PARENT_TAG,
    PID_TAG,
    RUN_KIND_TAG,
    SLURM_JOB_TAG,
    STORED_ARTIFACTS_TAG,
    fold_runs,
    redact_uri,
)
from pipeline.runs.store.unreachable import EXIT_UNREACHABLE, bound_retries, is_unreachable, unreachable_line
from pipeline.utils.accelerator import training_device

log = logging.getLogger(__name__)


class StopWhenLeaseLost(pl.Callback):
    """Ends training at the next step once the fold's heartbeat has seen its attempt taken over by another job
    (`fold_lease.LeaseLost` raised in the loop: an error, not a stop that Lightning would end the fit on as if done)."""

    def __init__(self, heartbeat: fold_lease.Heartbeat) -> None:
        self.heartbeat = heartbeat

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.heartbeat.check()

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self.heartbeat.check()


def result_from_run(client: MlflowClient, run) -> FoldResult:
    """A finished fold read back from its child run (metrics and prediction tables)."""
    run_id = run.info.run_id
    frames = pd.read_csv(client.download_artifacts(run_id, FRAME_PREDICTIONS))
    videos = pd.read_csv(client.download_artifacts(run_id, VIDEO_PREDICTIONS))
    seed = run.data.tags.get("seed")
    return FoldResult(int(run.data.tags["fold"]), dict(run.data.metrics), frames, videos, run_seconds(run), run_id,
                      int(seed) if seed not in (None, "") else None)


def run_seconds(run: Run) -> float:
    """How long a fold run ran, start to end (to now's record, while it runs: 0)."""
    return ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000


def job_owner_tags() -> dict[str, str]:
    """Where a fold attempt runs: lets a later driver tell a live attempt from a dead one. The host is this machine's
    identity (host name, boot id, PID namespace: `fold_lease.machine_identity`), so that a process number is judged
    only where it means that process."""
    tags = {HOST_TAG: fold_lease.machine_identity(), PID_TAG: str(os.getpid())}
    slurm_job = fold_lease.own_slurm_job()
    if slurm_job:
        tags[SLURM_JOB_TAG] = slurm_job
    return tags


# what a fold run copies of its parent's tags (FoldJob.parent_tags)
PARENT_TAGS_COPIED = ("model", "dataset", "protocol", "task", "subject_set", "seed")


def counted_attempts(client: MlflowClient, job: FoldJob, experiment_id: str) -> list[Run]:
    """The fold's attempts, newest first, with any FINISHED one whose artifacts are gone retired first."""
    runs = fold_runs(client, job.parent_run_id, job.fold, job.seed, experiment_id)
    return fold_runs(client, job.parent_run_id, job.fold, job.seed, experiment_id) if retire_unreadable(
        client, runs) else runs


def parent_facts(client: MlflowClient, job: FoldJob) -> tuple[str, dict[str, str]]:
    """The parent's experiment and the tags a fold run copies: as the job carries them, or for a job written without
    them, read from the parent run."""
    if job.experiment_id and job.parent_tags:
        return job.experiment_id, {key: str(job.parent_tags.get(key, "")) for key in PARENT_TAGS_COPIED}
    parent = client.get_run(job.parent_run_id)
    return parent.info.experiment_id, {key: parent.data.tags.get(key, "") for key in PARENT_TAGS_COPIED}


def run_fold_job(job: FoldJob) -> FoldResult:
    """Run one fold under its own child run of `job.parent_run_id`; see the module docstring for the rules. A job
    whose attempt is taken over by another job (`fold_lease.LeaseLost`) leaves that attempt unfinished and waits
    for the fold like any other job: it returns the result of whichever attempt finishes it."""
    client = MlflowClient(job.tracking_uri)
    cfg = OmegaConf.create(job.config)
    retry_s = OmegaConf.select(cfg, "mlflow.retry_s")
    if retry_s is not None:  # a server that goes away: each call retries it this long (unreachable.bound_retries)
        bound_retries(float(retry_s))
    experiment_id, parent_tags = parent_facts(client, job)
    # a lease in the store: a fold another machine trains now is waited for, a dead attempt replaced (fold_lease)
    lease_s = float(OmegaConf.select(cfg, "cv.lease_s", default=300))
    owner = fold_lease.new_owner()
    watch = fold_lease.Watch(lease_s)  # what this job has seen of other attempts, on its own clock
    while True:
        attempt, finished = fold_lease.acquire(client, job.parent_run_id, job.fold, job.seed, owner, lease_s,
                                               lambda: counted_attempts(client, job, experiment_id), watch=watch)
        if finished is not None:
            log.info("fold %d (seed %s) already has a finished run %s", job.fold, job.seed, finished.info.run_id)
            return result_from_run(client, finished)
        try:
            return train_attempt(client, job, cfg, attempt, owner, lease_s, experiment_id, parent_tags)
        except fold_lease.LeaseLost as lost:
            print(f"fold {job.fold}{'' if job.seed is None else f' (seed {job.seed})'}: {lost}; this job stopped "
                  f"without finishing it and waits for the fold", flush=True)


def train_attempt(client: MlflowClient, job: FoldJob, cfg: DictConfig, attempt: int, owner: str, lease_s: float,
                  experiment_id: str, parent_tags: dict[str, str]) -> FoldResult:
    """Attempt `attempt` of the fold, claimed by `owner`: its child run (in `experiment_id`, with `parent_tags`),
    trained under a heartbeat, its records gathered and written at once (`RunRecord`), sealed, FINISHED.
    `fold_lease.LeaseLost` when another job took it over meanwhile (the run is then left KILLED, never FINISHED)."""
    tags = dict(parent_tags)
    if job.seed is not None:  # one of several training seeds: the fold is trained with it, and tagged so
        cfg.seed = job.seed
        tags["seed"] = str(job.seed)
    work_dir = Path(job.work_dir)
    mlflow.set_tracking_uri(job.tracking_uri)
    name = f"fold {job.fold}" + (f" seed {job.seed}" if job.seed is not None else "")
    run = mlflow.start_run(experiment_id=experiment_id, run_name=name,
                           tags={**tags, PARENT_TAG: job.parent_run_id, RUN_KIND_TAG: FOLD_RUN,
                                 FOLD_TAG: str(job.fold), ATTEMPT_TAG: str(attempt),
                                 JOB_TRACKING_URI_TAG: redact_uri(job.store_uri or job.tracking_uri),
                                 **job_owner_tags(),
                                 **fold_lease.lease_tags(owner)})
    record = RunRecord(client, run.info.run_id, run.info.artifact_uri)
    heartbeat = fold_lease.Heartbeat(client, run.info.run_id, lease_s / 5, owner)  # renewed while the fold trains
    try:
        with heartbeat:
            record.log_params({"fold": job.fold, **({"seed": job.seed} if job.seed is not None else {})})
            device = training_device(cfg.trainer.accelerator)  # this node's device; no usable GPU asked for: an error
            # decided where the device is known
            settings = settings_on_device(job.decisions, cfg.trainer.channels_last, device.kind)
            log.info("fold %d: %s; %s", job.fold, device.line, settings.line)
            record.set_tags(device.tags)
            result = train_fold(cfg, job.fold, job.decisions, work_dir, keep_model=cfg.cv.log_models,
                                settings=settings, callbacks=[StopWhenLeaseLost(heartbeat)], record=record)
            heartbeat.check()
            stored = seal_fold(record, work_dir, keep_model=cfg.cv.log_models)
            record.set_tags({STORED_ARTIFACTS_TAG: json.dumps(stored, sort_keys=True)})
            record.flush()  # parameters, tags and metrics in one request, before the run is FINISHED
        heartbeat.confirm()  # the run read once more, the heartbeat stopped: a job taken over never finishes it
    except fold_lease.LeaseLost as lost:
        record.set_tags({LEASE_LOST_TAG: str(lost)})
        flush_what_was_gathered(record)
        end_fold_run("KILLED")
        raise
    except BaseException as error:
        if is_unreachable(error):  # nothing more reaches the store: the run stays RUNNING, resumed from there
            raise
        client.log_text(run.info.run_id, traceback.format_exc(), "traceback.txt")
        flush_what_was_gathered(record)
        end_fold_run("KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED")
        raise
    end_fold_run(FINISHED)
    keep_only_artifacts(work_dir)  # the rest of the folder goes once the CV is FINISHED (its aggregate step)
    result.run_id, result.seed = run.info.run_id, job.seed
    return result


def flush_what_was_gathered(record: RunRecord) -> None:
    """An unfinished attempt's parameters, tags and metrics, to read its failure by; one that the store refuses (a
    parameter another attempt of this run's wrote otherwise) is said, never raised over the failure itself."""
    try:
        record.flush()
    except Exception as error:  # noqa: BLE001 - the failure being handled is the one to raise
        log.warning("run %s: what it gathered was not written (%s)", record.run_id, error)


def end_fold_run(status: str) -> None:
    """`mlflow.end_run`, without the "View run" line MLflow prints for a tracking server's run (it reads the run
    back from the server for it: a request per fold for a line in a log)."""
    was = os.environ.get(URL_PRINTING_OFF.name)
    URL_PRINTING_OFF.set(True)
    try:
        mlflow.end_run(status)
    finally:
        if was is None:
            URL_PRINTING_OFF.unset()
        else:
            os.environ[URL_PRINTING_OFF.name] = was


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline fold-job <job.json>`: run one fold job (what the parallel launcher starts per fold)."""
    from pipeline.utils.logging_setup import setup_logging

    args = sys.argv[1:] if argv is None else argv
    setup_logging()
    job = FoldJob.read(Path(args[0]))
    try:
        run_fold_job(job)
    except Exception as error:
        if not is_unreachable(error):
            raise
        print(unreachable_line(job.tracking_uri, job.name), file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    return 0
