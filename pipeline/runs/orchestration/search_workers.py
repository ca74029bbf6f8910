"""The search's workers: each asks the studies for trials until every study has `tune.trials` finished ones, and
trains each trial as a fold job with other settings (`fold_job.train`, a two-stage head's second stage included) on
the fold's roles with its validation subjects as the test split (`SubjectRoles.validation_as_test`), so the fold's
test subjects are never read by a study. A worker (`TuneWorker`) is a launcher's job (`launchers.Job`, keyed by its
index) and runs on the CV's launchers: here (`launcher=local`), as `python -m pipeline tune-worker <spec.json>`
processes (`launcher=parallel`, through `launchers.job_store`'s private server over a database store) or as SLURM
array tasks (`launcher=slurm`).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlflow
import numpy as np
import optuna
import pytorch_lightning as pl
from mlflow import MlflowClient
from omegaconf import OmegaConf

from pipeline.data.datamodule import SubjectRoles
from pipeline.runs.jobs.fold_decisions import FoldDecisions, settings_here
from pipeline.runs.jobs.fold_job import build_fold, train
from pipeline.runs.jobs.fold_run import job_owner_tags
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.search_space import SearchSpace, TuneError, load_space, with_params
from pipeline.runs.orchestration.studies import (
    FINISHED_STATES,
    TuneSettings,
    finished_trials,
    open_storage,
    open_study,
    study_lock,
)
from pipeline.runs.store import tracking
from pipeline.utils.atomic_io import atomic_path

log = logging.getLogger(__name__)


class ReportToTrial(pl.Callback):
    """Each epoch's validation score to the Optuna trial; stops the fit when the pruner says the trial is hopeless
    (after the epoch, so its curve and checkpoint are whole). Written on Lightning's Callback API: optuna-integration's
    callback targets the `lightning` package, and this project trains with `pytorch_lightning`."""

    def __init__(self, trial: optuna.Trial, monitor: str, step_offset: int = 0, report: bool = True) -> None:
        self.trial, self.monitor, self.step_offset, self.report = trial, monitor, step_offset, report
        self.pruned_at: int | None = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None or not self.report:
            return
        epoch = trainer.current_epoch
        self.trial.report(float(value), self.step_offset + epoch)
        if self.trial.should_prune():
            self.pruned_at = epoch
            trainer.should_stop = True


@dataclass(frozen=True)
class TuneWorker:
    """What a worker needs, as plain values (JSON for a subprocess, pickled for submitit); a launcher's job
    (`launchers.Job`), keyed by its index `worker`."""

    config: dict  # the resolved config of the search
    studies: list[tuple[str, int | None]]  # (study name, fold; None: the shared study)
    folds: list[int]  # the folds a shared trial trains
    storage: str  # the journal file
    tuning_run_id: str
    tracking_uri: str
    work_dir: str
    decisions: dict  # FoldDecisions as a dict
    worker: int = 0
    tool: ClassVar[str] = "tune-worker"  # `python -m pipeline tune-worker <spec.json>` runs it in a process of its own

    @property
    def key(self) -> int:
        return self.worker

    @property
    def name(self) -> str:
        return f"search worker {self.worker}"

    def file(self, kind: str) -> Path:
        """Its spec ("json") or log ("log") in the search's folder."""
        return Path(self.work_dir) / f"worker_{self.worker}.{kind}"

    def run(self) -> int:
        return run_worker(self)

    def write(self, path: Path) -> Path:
        """The worker as JSON, owner only; a tracking URI with a password is refused (the worker reaches its server
        with the credentials in its environment)."""
        if tracking.uri_has_credentials(self.tracking_uri):
            raise ValueError(f"search worker {path}: the tracking URI {tracking.redact_uri(self.tracking_uri)} "
                             f"carries a password, and a job file holds none")
        with atomic_path(path, mode=0o600) as tmp:
            tmp.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> TuneWorker:
        values = json.loads(Path(path).read_text())
        return cls(**{**values, "studies": [tuple(s) for s in values["studies"]]})


def train_trial(worker: TuneWorker, trial: optuna.Trial, fold: int, params: dict[str, Any], step_offset: int = 0,
                report: bool = True) -> tuple[float, int | None]:
    """Train fold `fold` with the trial's settings under a child run of the tuning run; its best validation score
    and the epoch it was pruned after (None: not pruned)."""
    config = with_params(worker.config, params)
    training = TrainingSettings.from_config(OmegaConf.create(config))  # the trial's settings, read once
    decisions = FoldDecisions(**worker.decisions)
    client = MlflowClient(worker.tracking_uri)
    parent = client.get_run(worker.tuning_run_id)
    tags = tracking.inherited_tags(parent, tuple(n for n in tracking.INHERITED_TAGS if n != tracking.SEED_TAG))
    mlflow.set_tracking_uri(worker.tracking_uri)
    run = mlflow.start_run(experiment_id=parent.info.experiment_id, run_name=f"fold {fold} trial {trial.number}",
                           tags={**tags, tracking.PARENT_TAG: worker.tuning_run_id,
                                 tracking.RUN_KIND_TAG: tracking.TRIAL_RUN, tracking.FOLD_TAG: str(fold),
                                 tracking.TRIAL_TAG: str(trial.number), tracking.STUDY_TAG: trial.study.study_name,
                                 tracking.TUNE_SCOPE_TAG: config["tune"]["scope"], **job_owner_tags()})
    work_dir = Path(worker.work_dir) / f"fold_{fold}" / f"trial_{trial.number}"
    try:
        with tracking.run_lifecycle(run.info.run_id, client):
            try:
                value, pruned_at = trial_on_run(training, fold, decisions, work_dir, trial, params, step_offset,
                                                report)
            except BaseException:
                mlflow.set_tag(tracking.TRIAL_STATE_TAG, tracking.TRIAL_FAIL)
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)  # epoch checkpoints of a trial are not kept
    return value, pruned_at


def trial_on_run(training: TrainingSettings, fold: int, decisions: FoldDecisions, work_dir: Path, trial: optuna.Trial,
                 params: dict[str, Any], step_offset: int, report: bool) -> tuple[float, int | None]:
    """The trial's fold trained on the active trial run: its value, logged with its state and what was selected, and
    the epoch it was pruned after (None: not pruned)."""
    mlflow.log_params({"fold": fold, "trial": trial.number, **params})
    # precision and channels_last decided on this worker's device
    settings = settings_here(decisions, training.trainer.channels_last, training.trainer.accelerator)
    trains = WhatTrains.of(training).check()
    mlflow.set_tags({**tracking.device_settings_tags(settings), **trains.tags()})  # a frozen trial: the cache
    reporter = ReportToTrial(trial, training.trainer.monitor, step_offset, report)
    # the CV's training path on the study's subjects, second stage included: the value is the validation score of
    # what the tuned CV would keep (a two-stage head's, after its frame model's epochs fed the pruner)
    # the fold's training and validation subjects; its test subjects' rows are never loaded (the validation subjects
    # stand in as the unused test split)
    roles = SubjectRoles.of_fold(Path(decisions.fold_file), fold).validation_as_test()
    built = build_fold(training, trains, roles, decisions, settings)
    result = train(training, built, work_dir, settings, callbacks=[reporter], scored=())
    value = trains.mode.trial_value(result, training.trainer.monitor_mode)
    mlflow.log_metrics({"tune/value": value, "best_epoch": result.best_epoch,
                        "epochs_trained": result.epochs_trained,
                        **({"tune/frame_model_epochs": len(result.history)} if result.head is not None else {})})
    pruned = reporter.pruned_at is not None
    mlflow.set_tag(tracking.TRIAL_STATE_TAG, tracking.TRIAL_PRUNED if pruned else tracking.TRIAL_COMPLETE)
    return value, reporter.pruned_at


def objective(worker: TuneWorker, space: SearchSpace, trial: optuna.Trial, fold: int | None) -> float:
    """A per-fold trial: one fold's best validation score. A shared trial: the mean over the folds (reported after
    each fold, so a hopeless shared trial stops between folds)."""
    params = space.suggest(trial)
    if fold is not None:
        value, pruned_at = train_trial(worker, trial, fold, params)
        if pruned_at is not None:
            raise optuna.TrialPruned(f"fold {fold}: validation score below the median after epoch {pruned_at}")
        return value
    scores = []
    for position, each in enumerate(worker.folds):
        value, _ = train_trial(worker, trial, each, params, report=False)
        scores.append(value)
        trial.report(float(np.mean(scores)), position)
        if position < len(worker.folds) - 1 and trial.should_prune():
            raise optuna.TrialPruned(f"mean validation score below the median after {position + 1} fold(s)")
    return float(np.mean(scores))


def run_worker(worker: TuneWorker) -> int:
    """Ask each study for trials until it has `tune.trials` finished ones; returns the number of trials run here."""
    cfg = OmegaConf.create(worker.config)  # the worker's entry: its config read once
    tune = TuneSettings.from_config(cfg)
    space = load_space(tune.space, tune.model, WhatTrains.of(TrainingSettings.from_config(cfg)), worker.config)
    storage = open_storage(worker.storage)
    ran = 0
    for name, fold in worker.studies:
        study = open_study(tune, storage, name, fold, worker.worker)
        failures = 0
        while True:
            with study_lock(worker.storage):
                states = [t.state for t in study.get_trials(deepcopy=False)]
                done = sum(state in FINISHED_STATES for state in states)
                running = states.count(optuna.trial.TrialState.RUNNING)
                if done + running >= tune.trials:
                    break
                trial = study.ask()
                owner = job_owner_tags()
                trial.set_user_attr("host", owner[tracking.HOST_TAG])
                trial.set_user_attr("pid", owner[tracking.PID_TAG])
                if tracking.SLURM_JOB_TAG in owner:
                    trial.set_user_attr("slurm_job", owner[tracking.SLURM_JOB_TAG])
            ran += 1
            try:
                value = objective(worker, space, trial, fold)
            except optuna.TrialPruned as pruned:
                log.info("%s trial %d pruned: %s", name, trial.number, pruned)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                failures = 0
                continue
            except Exception as error:  # noqa: BLE001 - the trial's run holds the traceback; the study goes on
                failures += 1
                log.warning("%s trial %d failed: %s: %s", name, trial.number, type(error).__name__, error)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                if failures >= tune.max_failures:
                    raise TuneError(f"study {name}: {failures} trials in a row failed (last: {error}); see the "
                                    f"trial runs' traceback.txt") from error
                continue
            failures = 0
            study.tell(trial, value)
            print(f"{name}: trial {trial.number} value {value:.4f} ({len(finished_trials(study))}/"
                  f"{tune.trials} finished)", flush=True)
    return ran


def tune_worker_main(argv: list[str] | None = None) -> int:
    """`python -m pipeline tune-worker <spec.json>`: one search worker (what the parallel launcher starts)."""
    from pipeline.utils.logging_setup import setup_logging

    args = sys.argv[1:] if argv is None else argv
    setup_logging()
    run_worker(TuneWorker.read(Path(args[0])))
    return 0


def report_worker(worker: int, state: str, detail: Any) -> None:
    """A worker's state changes as the launchers report them: its process (pid, log) or SLURM job, a failure with its
    log."""
    if state == "failed":
        print(f"search worker {worker} failed: {detail}", flush=True)
    elif state == "done":
        print(f"search worker {worker}: done", flush=True)
    elif detail:
        print(f"search worker {worker}: {detail}", flush=True)


def worker_result(folder: Path, job_id: str) -> int | None:
    """The trials a SLURM worker ran, as submitit recorded its result in `folder`; None when it recorded an error or
    nothing (killed, cancelled)."""
    from submitit.core.utils import pickle_load

    try:
        state, value = pickle_load(folder / f"{job_id}_0_result.pkl")
    except (OSError, EOFError, ValueError):
        return None
    return value if state == "success" else None


def launch_workers(launcher: launchers.LauncherSettings, model_name: str, worker: TuneWorker, client: MlflowClient,
                   experiment_id: str) -> None:
    """Run the search's workers on the CV's launchers: one here (`local`), `launcher.jobs` processes here, each in its
    CPU or GPU slot (`parallel`), or one SLURM array task per study, at most `launcher.array_parallelism` (`slurm`),
    writing where `launchers.job_store` says, with the credentials made for them. A worker that fails is reported with
    its log (the search then finds its studies short); Ctrl-C stops the workers."""
    if launcher.name == "slurm":  # one SLURM array task per study (per fold), at most launcher.array_parallelism
        n_jobs = max(1, min(int(launcher.array_parallelism or 1), len(worker.studies)))
    else:
        n_jobs = int(launcher.jobs or 1) if launcher.name == "parallel" else 1
    with launchers.job_store(launcher.name, worker.tracking_uri, client, experiment_id,
                             "search workers") as (uri, credentials):
        workers = [replace(worker, worker=k, tracking_uri=uri) for k in range(n_jobs)]
        if launcher.name == "local":
            launchers.launch_local(workers, report_worker)
        elif launcher.name == "parallel":
            launchers.launch_parallel(workers, n_jobs, report_worker, lambda _: "exit code 0", credentials)
        else:
            folder = Path(worker.work_dir) / "slurm"
            job_ids = launchers.submit_slurm(workers, launcher, folder, f"painvit-tune-{model_name}",
                                             credentials)
            print(f"submitted {n_jobs} search worker(s) to SLURM: {', '.join(job_ids.values())}", flush=True)
            launchers.wait_slurm(job_ids, report_worker, lambda k: worker_result(folder, job_ids[k]),
                                 launcher.poll_s)
