"""A fold job (`FoldJob`) and its child run: one fold of a cross-validation trained anywhere (this process, another
process, a SLURM node) under a run of its own, idempotently. A `FoldJob` holds plain values only (the resolved config,
the fold id, the parent run id, the tracking URI and a work folder), so it pickles for submitit and writes as JSON
for a subprocess.

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

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import mlflow
import pandas as pd
import pytorch_lightning as pl
import torch
from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT as URL_PRINTING_OFF
from omegaconf import OmegaConf

from pipeline.models.fold_result import FoldResult
from pipeline.runs.jobs.fold_decisions import FoldDecisions, settings_on_device
from pipeline.runs.jobs.fold_job import prepare_shared_embeddings, train_fold
from pipeline.runs.jobs.sealing import (
    FRAME_PREDICTIONS,
    VIDEO_PREDICTIONS,
    keep_only_artifacts,
    retire_unreadable,
    seal_fold,
)
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.store import fold_lease
from pipeline.runs.store.run_record import RunRecord
from pipeline.runs.store.tracking import (
    ATTEMPT_TAG,
    FOLD_RUN,
    FOLD_TAG,
    HOST_TAG,
    INHERITED_TAGS,
    JOB_TRACKING_URI_TAG,
    LEASE_LOST_TAG,
    PARENT_TAG,
    PID_TAG,
    RUN_KIND_TAG,
    SEED_TAG,
    SLURM_JOB_TAG,
    STORED_ARTIFACTS_TAG,
    fold_runs,
    inherited_tags,
    redact_uri,
    run_lifecycle,
    training_device_tags,
    uri_has_credentials,
)
from pipeline.runs.store.unreachable import EXIT_UNREACHABLE, bound_retries, is_unreachable, unreachable_line
from pipeline.utils.accelerator import training_device
from pipeline.utils.atomic_io import atomic_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoldJob:
    """Everything a fold needs, as plain values; a launcher's job (`launchers.Job`), keyed by its fold."""

    config: dict  # the resolved config (OmegaConf.to_container)
    fold: int
    parent_run_id: str
    tracking_uri: str
    work_dir: str  # the fold's own folder: epoch checkpoints (for resuming) and the kept model before upload
    decisions: FoldDecisions
    seed: int | None = None  # cv.seeds: this training seed instead of the config's `seed` (tagged on the child run)
    store_uri: str = ""  # the store the records live in (behind a launcher's server), tagged; "": tracking_uri
    # the parent run's experiment and the tags its fold runs copy (tracking.INHERITED_TAGS), as the plan knows them;
    # empty (a job written before they travelled): read from the parent run
    experiment_id: str = ""
    parent_tags: dict = field(default_factory=dict)
    tool: ClassVar[str] = "fold-job"  # `python -m pipeline fold-job <job.json>` runs it in a process of its own

    @property
    def key(self) -> int:
        return self.fold

    def training(self) -> TrainingSettings:
        """The job's training settings, read from its config, with its seed where it has one."""
        training = TrainingSettings.from_config(OmegaConf.create(self.config))
        return training if self.seed is None else training.with_seed(self.seed)

    def prepare_shared_embeddings(self) -> None:
        """The embedding cache's entry this job's fold reads, built in this process where missing, and said so
        (`fold_job.prepare_shared_embeddings`)."""
        entry = prepare_shared_embeddings(self.training(), self.decisions)
        if entry is not None and entry.built:
            print(f"embedding cache: the shared entry built here on {torch.get_num_threads()} thread(s) in "
                  f"{entry.seconds:.0f} s, before the fold jobs", flush=True)

    @property
    def name(self) -> str:
        return f"fold {self.fold}" + (f" (seed {self.seed})" if self.seed is not None else "")

    def file(self, kind: str) -> Path:
        """Its spec ("json") or log ("log") beside the fold's folder."""
        return Path(self.work_dir).parent / f"fold_{self.fold}.{kind}"

    def run(self) -> FoldResult:
        return run_fold_job(self)

    def write(self, path: Path) -> Path:
        """The job as JSON, owner only; no password in it: a tracking URI with one is refused (a job reaches its
        server with the credentials in its environment), and the store URI is written redacted."""
        if uri_has_credentials(self.tracking_uri):
            raise ValueError(f"fold job {path}: the tracking URI {redact_uri(self.tracking_uri)} carries a password, "
                             f"and a job file holds none")
        with atomic_path(path, mode=0o600) as tmp:
            tmp.write_text(json.dumps({**asdict(self), "store_uri": redact_uri(self.store_uri)}))
        return path

    @classmethod
    def read(cls, path: Path) -> FoldJob:
        values = json.loads(Path(path).read_text())
        return cls(**{**values, "decisions": FoldDecisions(**values["decisions"])})


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
    seed = run.data.tags.get(SEED_TAG)
    metrics = dict(run.data.metrics)
    return FoldResult(int(run.data.tags[FOLD_TAG]), metrics, frames, videos, run_seconds(run), run_id,
                      int(seed) if seed not in (None, "") else None, best_epoch=int(metrics.get("best_epoch", -1)),
                      epochs_trained=int(metrics.get("epochs_trained", 0)),
                      best_score=metrics.get("best_val_score", float("nan")))


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


def counted_attempts(client: MlflowClient, job: FoldJob, experiment_id: str) -> list[Run]:
    """The fold's attempts, newest first, with any FINISHED one whose artifacts are gone retired first."""
    runs = fold_runs(client, job.parent_run_id, job.fold, job.seed, experiment_id)
    return fold_runs(client, job.parent_run_id, job.fold, job.seed, experiment_id) if retire_unreadable(
        client, runs) else runs


def parent_facts(client: MlflowClient, job: FoldJob) -> tuple[str, dict[str, str]]:
    """The parent's experiment and the tags a fold run copies: as the job carries them, or for a job written without
    them, read from the parent run."""
    if job.experiment_id and job.parent_tags:
        return job.experiment_id, {name: str(job.parent_tags.get(name, "")) for name in INHERITED_TAGS}
    parent = client.get_run(job.parent_run_id)
    return parent.info.experiment_id, inherited_tags(parent)


def run_fold_job(job: FoldJob) -> FoldResult:
    """Run one fold under its own child run of `job.parent_run_id`; see the module docstring for the rules. A job
    whose attempt is taken over by another job (`fold_lease.LeaseLost`) leaves that attempt unfinished and waits
    for the fold like any other job: it returns the result of whichever attempt finishes it."""
    client = MlflowClient(job.tracking_uri)
    cfg = OmegaConf.create(job.config)  # the job's entry: its config read once, into typed settings
    training = job.training()  # with the job's seed, where it has one
    retry_s = OmegaConf.select(cfg, "mlflow.retry_s")
    if retry_s is not None:  # a server that goes away: each call retries it this long (unreachable.bound_retries)
        bound_retries(float(retry_s))
    experiment_id, parent_tags = parent_facts(client, job)
    # a lease in the store: a fold another machine trains now is waited for, a dead attempt replaced (fold_lease)
    lease_s = float(cfg.cv.lease_s)
    owner = fold_lease.new_owner()
    watch = fold_lease.Watch(lease_s)  # what this job has seen of other attempts, on its own clock
    while True:
        attempt, finished = fold_lease.acquire(client, job.parent_run_id, job.fold, job.seed, owner, lease_s,
                                               lambda: counted_attempts(client, job, experiment_id),
                                               watch=watch)
        if finished is not None:
            log.info("fold %d (seed %s) already has a finished run %s", job.fold, job.seed, finished.info.run_id)
            return result_from_run(client, finished)
        try:
            return train_attempt(client, job, training, attempt, owner, lease_s, experiment_id, parent_tags)
        except fold_lease.LeaseLost as lost:
            print(f"fold {job.fold}{'' if job.seed is None else f' (seed {job.seed})'}: {lost}; this job stopped "
                  f"without finishing it and waits for the fold", flush=True)


def train_attempt(client: MlflowClient, job: FoldJob, training: TrainingSettings, attempt: int, owner: str,
                  lease_s: float, experiment_id: str, parent_tags: dict[str, str]) -> FoldResult:
    """Attempt `attempt` of the fold, claimed by `owner`: its child run (in `experiment_id`, with `parent_tags`),
    trained under a heartbeat, its records gathered and written at once (`RunRecord`), sealed, FINISHED.
    `fold_lease.LeaseLost` when another job took it over meanwhile (the run is then left KILLED, never FINISHED)."""
    tags = dict(parent_tags)
    if job.seed is not None:  # one of several training seeds: `training` has it (`FoldJob.training`), tagged so
        tags[SEED_TAG] = str(job.seed)
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
    # FINISHED only once sealed; a store that does not answer: the run stays RUNNING, resumed from there
    with no_run_url_line(), run_lifecycle(run.info.run_id, client, stopped=(fold_lease.LeaseLost,),
                                          left_running=is_unreachable):
        try:
            with heartbeat:
                result = train_under_heartbeat(job, training, record, work_dir, heartbeat)
                record.flush()  # parameters, tags and metrics in one request, before the run is FINISHED
            heartbeat.confirm()  # the run read once more, the heartbeat stopped: a job taken over never finishes it
        except BaseException as error:
            if isinstance(error, fold_lease.LeaseLost):
                record.set_tags({LEASE_LOST_TAG: str(error)})
            if not is_unreachable(error):  # an unfinished attempt's records, to read its failure by
                flush_what_was_gathered(record)
            raise
    keep_only_artifacts(work_dir)  # the rest of the folder goes once the CV is FINISHED (its aggregate step)
    result.run_id, result.seed = run.info.run_id, job.seed
    return result


def train_under_heartbeat(job: FoldJob, training: TrainingSettings, record: RunRecord, work_dir: Path,
                          heartbeat: fold_lease.Heartbeat) -> FoldResult:
    """The fold trained on this node's device, its run sealed (`seal_fold`): what the CV will read is in the store,
    its parameters, tags and metrics gathered in `record`."""
    record.log_params({"fold": job.fold, **({"seed": job.seed} if job.seed is not None else {})})
    device = training_device(training.trainer.accelerator)  # this node's device; no usable GPU asked for: an error
    # decided where the device is known
    settings = settings_on_device(job.decisions, training.trainer.channels_last, device.kind)
    log.info("fold %d: %s; %s", job.fold, device.line, settings.line)
    record.set_tags(training_device_tags(device))
    result = train_fold(training, job.fold, job.decisions, work_dir, keep_model=training.log_models, settings=settings,
                        callbacks=[StopWhenLeaseLost(heartbeat)], record=record)
    heartbeat.check()
    stored = seal_fold(record, work_dir, keep_model=training.log_models)
    record.set_tags({STORED_ARTIFACTS_TAG: json.dumps(stored, sort_keys=True)})
    return result


def flush_what_was_gathered(record: RunRecord) -> None:
    """An unfinished attempt's parameters, tags and metrics, to read its failure by; one that the store refuses (a
    parameter another attempt of this run's wrote otherwise) is said, never raised over the failure itself."""
    try:
        record.flush()
    except Exception as error:  # noqa: BLE001 - the failure being handled is the one to raise
        log.warning("run %s: what it gathered was not written (%s)", record.run_id, error)


@contextlib.contextmanager
def no_run_url_line() -> Iterator[None]:
    """`mlflow.end_run` within, without the "View run" line MLflow prints for a tracking server's run (it reads the
    run back from the server for it: a request per fold for a line in a log)."""
    was = os.environ.get(URL_PRINTING_OFF.name)
    URL_PRINTING_OFF.set(True)
    try:
        yield
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
