"""`make tune`: hyper-parameter search with Optuna inside the leave-subjects-out folds, then the tuned CV.

search -> choose -> cross-validate:
- **search**: one Optuna study per outer fold (`tune.scope=per_fold`, the default). A trial is a fold job with other
  settings: the CV's training path (`fold_job.train`, a two-stage head's second stage included), on a DataModule
  whose test split is the fold's validation subjects (`StudyDataModule`), so the fold's test subjects are never read
  by the study: not as the objective (the best validation score of what the CV would keep: a two-stage head's), not
  as the pruning signal (each epoch's validation score of the fitted network; a frozen backbone's two-stage head has
  no such epochs and is not pruned), not as the stopping rule. `tune.scope=shared` runs one study whose trial trains
  every fold and scores the mean validation score over folds: each fold's chosen settings then depend on models
  trained on its test subjects, so it is OPTIMISTIC, and every run, tag and line it prints says so.
- **choose**: each fold's best trial (or the shared study's best for every fold), written on the tuning run.
- **cross-validate**: the usual CV (`plan_cv`, `launch`, `aggregate`), each fold's job carrying its chosen settings;
  its parent is a CV run tagged as tuned, with the budget (trials, scope, search-space hash) `make compare` matches.

Studies live in an Optuna journal file under `tune.storage_dir` (next to the CV work folder; on shared disk a journal
serves many workers). A killed search rerun continues: finished trials are kept, a trial left RUNNING by a dead worker
is marked FAIL and its parameters are enqueued again. Workers are `python -m pipeline tune-worker <spec.json>`
processes (`launcher=parallel`) or SLURM array tasks (`launcher=slurm`), each asking the shared studies for trials.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import optuna
import pytorch_lightning as pl
from mlflow import MlflowClient
from omegaconf import DictConfig, OmegaConf
from optuna.storages.journal import JournalFileBackend

from pipeline.data.datamodule import PainDataModule
from pipeline.models.finetune import STRATEGY_NAMES, FinetuneConfig
from pipeline.runs.jobs.fold_job import FoldDecisions, FoldJob, Trained, resolve_here, train
from pipeline.runs.jobs.fold_run import job_owner_tags
from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.cross_validation import Plan, aggregate, identity_lock, launch, plan_cv
from pipeline.runs.store import cv_runs, fold_lease, tracking
from pipeline.runs.store.cv_runs import augmentation_applied, augmentation_label, finetune_tags, identity_config
from pipeline.runs.store.tracking_server import job_credentials
from pipeline.utils.accelerator import announce_device
from pipeline.utils.atomic_io import atomic_path, atomic_write_text, save_png
from pipeline.utils.config import CONFIG_DIR
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)
SPACES_DIR = CONFIG_DIR / "tune" / "spaces"
SCOPES = ("per_fold", "shared")
FINISHED_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
OPTIMISTIC = "OPTIMISTIC (shared study: each fold's settings were chosen with models that trained on its test subjects)"
CHOSEN_ARTIFACT = "chosen_params.json"


class TuneError(SystemExit):
    """A search that cannot run as configured, with what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


# ---------------------------------------------------------------------------------------------------------------
# The search space: configuration, read once.

@dataclass(frozen=True)
class Parameter:
    key: str  # a dotted config key, e.g. model.optim.head_lr
    type: str  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple | None = None

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.type == "float":
            return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.log)
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_categorical(self.key, list(self.choices or ()))

    def contains(self, value: Any) -> bool:
        if self.type == "categorical":
            return value in (self.choices or ())
        return value is not None and float(self.low) <= float(value) <= float(self.high)


@dataclass(frozen=True)
class SearchSpace:
    source: str  # the file(s) it was read from
    parameters: tuple[Parameter, ...]

    @property
    def sha256(self) -> str:
        """What `make compare` matches tuned CVs on: the parameters, ranges and scales, not the file names."""
        text = json.dumps([asdict(p) for p in self.parameters], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        return {p.key: p.suggest(trial) for p in self.parameters}

    def defaults(self, cfg: DictConfig) -> dict[str, Any]:
        """Today's hand-picked values of the searched keys: the study's first trial. Each must be in its range."""
        values = {}
        for p in self.parameters:
            value = OmegaConf.select(cfg, p.key, default=None)
            if not p.contains(value):
                raise TuneError(f"{self.source}: the configured {p.key} = {value!r} lies outside the searched range "
                                f"({p.choices if p.type == 'categorical' else f'{p.low}..{p.high}'}); widen the "
                                f"range so that the first trial is today's setting")
            values[p.key] = int(value) if p.type == "int" else float(value) if p.type == "float" else value
        return values


def _space_entries(name: str, seen: tuple[str, ...] = ()) -> tuple[dict, dict, list[str]]:
    path = SPACES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))
        raise TuneError(f"no search space {path}; known: {', '.join(known)}")
    if name in seen:
        raise TuneError(f"{path}: `extends` loops back to {name}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    unknown = sorted(set(raw) - {"extends", "parameters", "strategies"})
    if unknown:
        raise TuneError(f"{path}: unknown key(s) {unknown}; expected extends, parameters, strategies")
    parameters, strategies, sources = {}, {}, []
    if raw.get("extends"):
        parameters, strategies, sources = _space_entries(str(raw["extends"]), (*seen, name))
    parameters = {**parameters, **(raw.get("parameters") or {})}
    wrong = sorted(set(raw.get("strategies") or {}) - set(STRATEGY_NAMES))
    if wrong:  # a key no `model.finetune` takes would never apply: its study would search settings that do nothing
        raise TuneError(f"{path}: strategies key(s) {', '.join(map(repr, wrong))} name no fine-tuning strategy; "
                        f"model.finetune is one of {', '.join(STRATEGY_NAMES)}")
    for strategy, extra in (raw.get("strategies") or {}).items():
        strategies[strategy] = {**strategies.get(strategy, {}), **(extra or {})}
    return parameters, strategies, [*sources, str(path)]


def load_space(cfg: DictConfig) -> SearchSpace:
    """The search space for `cfg`: its backbone's file (or `tune.space`), with the fine-tuning strategy's changes.
    A run whose training applies no augmentation (a frozen head on plain cached embeddings, `augmentation_applied`)
    does not search `augment.*`: those settings would change nothing it trains on."""
    name = cfg.tune.space
    if name == "auto":
        name = cfg.model.name if (SPACES_DIR / f"{cfg.model.name}.yaml").is_file() else "default"
    entries, strategies, sources = _space_entries(str(name))
    strategy = FinetuneConfig.from_config(cfg).strategy
    if strategy in strategies:
        entries = {**entries, **strategies[strategy]}
    source = " + ".join(sources) + (f" (strategy {strategy})" if strategy in strategies else "")
    unaugmented = not augmentation_applied(cfg)
    if unaugmented:
        source += f" (augment.* not searched: {augmentation_label(cfg)})"
    parameters = []
    for key, spec in entries.items():
        if spec is None or (unaugmented and key.startswith("augment.")):  # removed, or nothing it would change
            continue
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            raise TuneError(f"{source}: parameter {key} is not a key of the composed config")
        kind = spec.get("type")
        if kind not in ("float", "int", "categorical"):
            raise TuneError(f"{source}: parameter {key}: type must be float, int or categorical, not {kind!r}")
        if kind == "categorical":
            parameters.append(Parameter(key, kind, choices=tuple(spec["choices"])))
            continue
        if spec.get("low") is None or spec.get("high") is None or spec["low"] >= spec["high"]:
            raise TuneError(f"{source}: parameter {key} needs low < high")
        parameters.append(Parameter(key, kind, spec["low"], spec["high"], bool(spec.get("log", False))))
    if not parameters:
        raise TuneError(f"{source}: no parameter to search")
    return SearchSpace(source, tuple(parameters))


def with_params(config: dict | DictConfig, params: dict[str, Any]) -> DictConfig:
    """A copy of the config with the trial's (or the chosen) values set at their dotted keys."""
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config)
    for key, value in params.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Studies: storage, sampler, pruner, stale trials.

def storage_path(cfg: DictConfig, search_key: str) -> Path:
    return resolve_path(cfg.tune.storage_dir) / f"{cfg.model.name}-{cfg.task.name}-{search_key[:12]}.journal"


def open_storage(path: str | Path) -> optuna.storages.JournalStorage:
    """Optuna's journal storage: an append-only file with a lock beside it, safe for many workers on a shared disk."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def make_sampler(tune: DictConfig, seed: int) -> optuna.samplers.BaseSampler:
    name = tune.sampler.name
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=tune.sampler.n_startup_trials,
                                          multivariate=tune.sampler.multivariate)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise TuneError(f"unknown tune.sampler.name {name!r}; known: tpe, random")


def make_pruner(tune: DictConfig) -> optuna.pruners.BasePruner:
    name = tune.pruner.name
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=tune.pruner.n_startup_trials,
                                           n_warmup_steps=tune.pruner.n_warmup_steps)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise TuneError(f"unknown tune.pruner.name {name!r}; known: median, none")


def open_study(cfg: DictConfig, storage: optuna.storages.BaseStorage, name: str, fold: int | None,
               worker: int = 0) -> optuna.Study:
    """The study `name` (created if new), with this worker's sampler: seeded by (seed, fold, worker), so a rerun draws
    the same trials and two workers do not draw the same ones."""
    seed = cfg.tune.sampler.seed if cfg.tune.sampler.seed is not None else cfg.seed
    direction = "maximize" if cfg.trainer.monitor_mode == "max" else "minimize"
    return optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True,
                               sampler=make_sampler(cfg.tune, int(seed) + 1000 * worker + (fold or 0)),
                               pruner=make_pruner(cfg.tune))


def owner_alive(attrs: dict) -> bool:
    """Whether the worker that started a RUNNING trial may still run it: on this host, its process is alive; on
    SLURM, its job is still queued; on another host without SLURM we cannot tell, and it is left alone."""
    if attrs.get("slurm_job"):
        return attrs["slurm_job"] in launchers.slurm_states([attrs["slurm_job"]])
    if "host" not in attrs:  # the owner is written right after the ask, under the same lock: abandoned between
        return False
    if fold_lease.on_this_machine(attrs.get("host")):  # host name, boot id, PID namespace: the pid means that process
        try:
            os.kill(int(attrs.get("pid", 0)), 0)
        except (OSError, ValueError):
            return False
        return True
    return True


def retry_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[int]:
    """Trials left RUNNING by a dead worker: marked FAIL, and their parameters enqueued again (a retry). Returns the
    numbers of the failed trials."""
    failed = []
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if owner_alive(trial.user_attrs):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        if storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL):
            # an enqueued trial's settings are all fixed from the start; a drawn one's are those it had drawn
            params = trial.system_attrs.get("fixed_params") or trial.params
            study.enqueue_trial(params, user_attrs={"retry_of": trial.number,
                                                          **{k: v for k, v in trial.user_attrs.items()
                                                             if k == "default"}})
            failed.append(trial.number)
    return failed


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=FINISHED_STATES)


@contextlib.contextmanager
def study_lock(storage: str | Path) -> Iterator[None]:
    """Workers take turns to count and ask, so that n trials means n, not n plus one per worker."""
    with open(f"{storage}.ask.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------------
# A trial: a fold job with other settings, on the fold's training and validation subjects only.

class StudyDataModule(PainDataModule):
    """A fold's frames for its study: train and validation subjects of the fold file; the fold's test subjects' rows
    are dropped from the frame table before any crop is loaded (the validation subjects stand in as the unused test
    split)."""

    def subject_roles(self) -> dict[str, list[str]]:
        roles = super().subject_roles()
        return {"train": roles["train"], "val": roles["val"], "test": roles["val"]}


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
    """What a worker needs, as plain values (JSON for a subprocess, pickled for submitit)."""

    config: dict  # the resolved config of the search
    studies: list[tuple[str, int | None]]  # (study name, fold; None: the shared study)
    folds: list[int]  # the folds a shared trial trains
    storage: str  # the journal file
    tuning_run_id: str
    tracking_uri: str
    work_dir: str
    decisions: dict  # FoldDecisions as a dict
    worker: int = 0

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
    cfg = with_params(worker.config, params)
    decisions = FoldDecisions(**worker.decisions)
    client = MlflowClient(worker.tracking_uri)
    parent = client.get_run(worker.tuning_run_id)
    tags = {k: parent.data.tags.get(k, "") for k in ("model", "dataset", "protocol", "task", "subject_set")}
    mlflow.set_tracking_uri(worker.tracking_uri)
    run = mlflow.start_run(experiment_id=parent.info.experiment_id, run_name=f"fold {fold} trial {trial.number}",
                           tags={**tags, tracking.PARENT_TAG: worker.tuning_run_id,
                                 tracking.RUN_KIND_TAG: tracking.TRIAL_RUN, tracking.FOLD_TAG: str(fold),
                                 tracking.TRIAL_TAG: str(trial.number), tracking.STUDY_TAG: trial.study.study_name,
                                 tracking.TUNE_SCOPE_TAG: cfg.tune.scope, **job_owner_tags()})
    work_dir = Path(worker.work_dir) / f"fold_{fold}" / f"trial_{trial.number}"
    try:
        mlflow.log_params({"fold": fold, "trial": trial.number, **params})
        settings = resolve_here(cfg, decisions)  # precision and channels_last decided on this worker's device
        mlflow.set_tags({**settings.tags(), **finetune_tags(cfg)})  # a frozen trial reads the embedding cache
        reporter = ReportToTrial(trial, cfg.trainer.monitor, step_offset, report)
        # the CV's training path on the study's subjects, second stage included: the value is the validation score of
        # what the tuned CV would keep (a two-stage head's, after its frame model's epochs fed the pruner)
        trained = train(cfg, fold, decisions, work_dir, settings, datamodule_class=StudyDataModule,
                        callbacks=[reporter], scored=())
        value = trial_value(cfg, trained)
        mlflow.log_metrics({"tune/value": value, "best_epoch": trained.selected["best_epoch"],
                            "epochs_trained": trained.selected["epochs_trained"],
                            **({"tune/frame_model_epochs": len(trained.history)} if trained.stage else {})})
        mlflow.set_tag(tracking.TRIAL_STATE_TAG, "PRUNED" if reporter.pruned_at is not None else "COMPLETE")
    except BaseException as error:
        mlflow.log_text(traceback.format_exc(), "traceback.txt")
        mlflow.set_tag(tracking.TRIAL_STATE_TAG, "FAIL")
        mlflow.end_run("KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED")
        raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)  # epoch checkpoints of a trial are not kept
    mlflow.end_run(tracking.FINISHED)
    del run
    return value, reporter.pruned_at


def trial_value(cfg: DictConfig, trained: Trained) -> float:
    """A trial's value in the study's direction (`trainer.monitor_mode`): the best validation score of what the CV
    would keep. A second stage's head scores higher-better (validation video AUROC, or minus the loss), so a study
    that minimises gets it negated."""
    score = float(trained.selected["best_val_score"])
    return -score if trained.stage is not None and cfg.trainer.monitor_mode == "min" else score


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
    cfg = OmegaConf.create(worker.config)
    space = load_space(cfg)
    storage = open_storage(worker.storage)
    ran = 0
    for name, fold in worker.studies:
        study = open_study(cfg, storage, name, fold, worker.worker)
        failures = 0
        while True:
            with study_lock(worker.storage):
                states = [t.state for t in study.get_trials(deepcopy=False)]
                done = sum(state in FINISHED_STATES for state in states)
                running = states.count(optuna.trial.TrialState.RUNNING)
                if done + running >= cfg.tune.trials:
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
                if failures >= cfg.tune.max_failures:
                    raise TuneError(f"study {name}: {failures} trials in a row failed (last: {error}); see the "
                                    f"trial runs' traceback.txt") from error
                continue
            failures = 0
            study.tell(trial, value)
            print(f"{name}: trial {trial.number} value {value:.4f} ({len(finished_trials(study))}/"
                  f"{cfg.tune.trials} finished)", flush=True)
    return ran


def worker_main(argv: list[str] | None = None) -> int:
    """`python -m pipeline tune-worker <spec.json>`: one search worker (what the parallel launcher starts)."""
    from pipeline.utils.logging_setup import setup_logging

    args = sys.argv[1:] if argv is None else argv
    setup_logging()
    run_worker(TuneWorker.read(Path(args[0])))
    return 0


class SlurmTuneTask:
    """The callable submitit runs on a node: one worker. Requeued on preemption; the journal keeps the trials."""

    def __init__(self, worker: TuneWorker) -> None:
        self.worker = worker

    def __call__(self) -> int:
        from pipeline.utils.logging_setup import setup_logging

        setup_logging()
        return run_worker(self.worker)

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(SlurmTuneTask(self.worker))


def launch_workers(cfg: DictConfig, worker: TuneWorker, client: MlflowClient, experiment_id: str) -> None:
    """Run the search's workers on the configured launcher: here, k processes here, or k SLURM array tasks."""
    launcher = cfg.launcher
    if launcher.name == "local":
        run_worker(worker)
        return
    if launcher.name == "parallel":
        n_jobs = int(launcher.jobs or 1)
    else:  # one SLURM array task per study (per fold), at most launcher.array_parallelism of them
        n_jobs = max(1, min(int(launcher.array_parallelism or 1), len(worker.studies)))
    if launcher.name == "slurm":
        folder = Path(worker.work_dir) / "slurm"
        executor = launchers.slurm_executor(launcher, folder, f"painvit-tune-{cfg.model.name}")
        credentials = job_credentials(worker.tracking_uri, [experiment_id])
        with launchers.submission_environment(credentials), executor.batch():
            handles = [executor.submit(SlurmTuneTask(replace(worker, worker=k))) for k in range(n_jobs)]
        print(f"submitted {n_jobs} search worker(s) to SLURM: {', '.join(str(h.job_id) for h in handles)}")
        for handle in handles:
            handle.result()
        return
    uri = worker.tracking_uri
    if uri.startswith(("http://", "https://")):
        server: contextlib.AbstractContextManager = contextlib.nullcontext(None)
    else:  # several writers: through a private server, never the database itself
        server = launchers.tracking_server(uri, client.get_experiment(experiment_id).artifact_location,
                                           experiment_ids=[experiment_id])
    with server as served:
        credentials = served.credentials if served else job_credentials(uri, [experiment_id])
        slots = launchers.job_slots(n_jobs, launchers.visible_gpus(), sorted(os.sched_getaffinity(0)))
        processes = []
        for k, slot in enumerate(slots):
            spec = replace(worker, worker=k, tracking_uri=served.uri if served else uri).write(
                Path(worker.work_dir) / f"worker_{k}.json")
            log_path = Path(worker.work_dir) / f"worker_{k}.log"
            with open(log_path, "ab") as log_file:
                processes.append((subprocess.Popen([sys.executable, "-m", "pipeline", "tune-worker", str(spec)],
                                                   env=launchers.job_environment(slot, credentials),
                                                   stdout=log_file, stderr=subprocess.STDOUT), log_path))
            print(f"search worker {k}: pid {processes[-1][0].pid}, log {log_path}", flush=True)
        try:
            for process, log_path in processes:
                if process.wait() != 0:
                    print(f"search worker (log {log_path}) exited with code {process.returncode}", flush=True)
        finally:
            for process, _ in processes:
                if process.poll() is None:
                    process.terminate()


# ---------------------------------------------------------------------------------------------------------------
# The driver: plan, search, choose, cross-validate.

@dataclass
class TunedPlan(Plan):
    """A cross-validation plan whose fold jobs carry each fold's chosen settings."""

    fold_params: dict[int, dict[str, Any]] = field(default_factory=dict)

    def job(self, fold: int, tracking_uri: str | None = None, seed: int | None = None) -> FoldJob:
        job = super().job(fold, tracking_uri, seed)
        return replace(job, config=OmegaConf.to_container(with_params(job.config, self.fold_params[int(fold)])))


def search_key(cfg: DictConfig, space: SearchSpace, fold_file_sha256: str, decisions: FoldDecisions) -> str:
    """What makes two searches the same study: the settings (without the trial budget, so a rerun with more trials
    continues the study), the search space, the fold file and the starting weights by what they are (the plan's
    SHA-256, or `random`), not by where the file lies: a file changed in place is another study, the same file
    moved is the same one."""
    config = identity_config(cfg)
    config.get("tune", {}).pop("trials", None)
    config.get("tune", {}).pop("max_failures", None)
    config.get("model", {}).pop("weights", None)
    weights = decisions.weights_source
    text = json.dumps({"config": config, "space": space.sha256, "folds": fold_file_sha256,
                       "weights": weights.sha256 or weights.kind}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def study_names(key: str, scope: str, folds: list[int]) -> list[tuple[str, int | None]]:
    if scope == "shared":
        return [(f"{key[:12]}-shared", None)]
    return [(f"{key[:12]}-fold{fold}", fold) for fold in folds]


def budget_tags(cfg: DictConfig, space: SearchSpace) -> dict[str, str]:
    trials, scope, space_hash = tracking.TUNE_BUDGET_TAGS
    return {tracking.TUNED_TAG: "true", trials: str(cfg.tune.trials), scope: cfg.tune.scope,
            space_hash: space.sha256[:16]}


def choose(studies: dict[str, optuna.Study], names: list[tuple[str, int | None]],
           fold_ids: list[int]) -> dict[int, dict[str, Any]]:
    """fold -> its chosen settings, value and trial (the shared study's best for every fold)."""
    chosen = {}
    for name, fold in names:
        best = studies[name].best_trial
        entry = {"params": dict(best.params), "value": best.value, "trial": best.number, "study": name,
                 "default_trial": bool(best.user_attrs.get("default"))}
        for each in ([fold] if fold is not None else fold_ids):
            chosen[int(each)] = entry
    return chosen


def log_search(client: MlflowClient, run_id: str, studies: dict[str, optuna.Study], chosen: dict, scope: str) -> None:
    """Chosen settings, every trial and Optuna's plots (matplotlib, no browser) onto the tuning run."""
    now = int(time.time() * 1000)
    from mlflow.entities import Metric

    metrics = [Metric(f"tune/best_value_fold{fold}", float(entry["value"]), now, 0) for fold, entry in chosen.items()]
    client.log_batch(run_id, metrics=metrics)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        note = {"scope": scope, "note": OPTIMISTIC if scope == "shared" else
                "per fold: each fold's settings were chosen on its validation subjects only"}
        atomic_write_text(out / CHOSEN_ARTIFACT, json.dumps({**note, "folds": {str(k): v for k, v in chosen.items()}},
                                                            indent=2, default=str))
        for name, study in studies.items():
            study.trials_dataframe().to_csv(out / f"trials_{name}.csv", index=False)
            plot_study(study, out / "plots", name)
        client.log_artifacts(run_id, str(out))


def plot_study(study: optuna.Study, out: Path, name: str) -> None:
    """Optimisation history, parameter importance and parallel coordinates as PNGs; a plot Optuna cannot draw yet
    (too few finished trials) is skipped with a note in the log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Callable[[optuna.Study], Any]] = {
        "history": optuna_plots.plot_optimization_history, "importance": optuna_plots.plot_param_importances,
        "parallel": optuna_plots.plot_parallel_coordinate}
    for kind, plot in plots.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                axes = plot(study)
        except (ValueError, RuntimeError, ZeroDivisionError) as error:
            log.info("%s: no %s plot (%s)", name, kind, error)
            continue
        figure = (axes.flat[0] if isinstance(axes, np.ndarray) else axes).figure
        save_png(figure, out / f"{name}_{kind}.png")
        plt.close(figure)


def prepare_studies(cfg: DictConfig, storage_file: Path, names: list[tuple[str, int | None]],
                    space: SearchSpace) -> dict[str, optuna.Study]:
    """Create or load the studies; a new study gets today's settings as its first trial; a trial left RUNNING by a
    dead worker is failed and retried."""
    storage = open_storage(storage_file)
    defaults = space.defaults(cfg)
    studies = {}
    with study_lock(storage_file):
        for name, fold in names:
            study = open_study(cfg, storage, name, fold)
            if not study.get_trials(deepcopy=False):
                study.enqueue_trial(defaults, user_attrs={"default": True})
            failed = retry_stale_trials(study, storage)
            if failed:
                print(f"{name}: trial(s) {', '.join(map(str, failed))} were left running by a stopped worker: "
                      f"marked failed, their settings queued again", flush=True)
            studies[name] = study
    return studies


def run_tune(cfg: DictConfig) -> dict:
    """Search per fold (or shared), choose, then cross-validate with the chosen settings; returns the tuned CV's
    aggregate metrics (empty when it could not finish)."""
    if cfg.tune.scope not in SCOPES:
        raise TuneError(f"unknown tune.scope {cfg.tune.scope!r}; known: {', '.join(SCOPES)}")
    space = load_space(cfg)
    space.defaults(cfg)  # a default outside its range fails before any data or training
    tracking_uri = tracking.store_uri(cfg.mlflow.tracking_uri)
    launchers.check_launcher(cfg.launcher, tracking_uri)
    client = MlflowClient(tracking_uri)
    if cfg.launcher.name != "slurm":  # said first; on SLURM each node says its own
        announce_device(cfg.trainer.accelerator)
    optimistic = cfg.tune.scope == "shared"
    if optimistic:
        print(f"tune.scope=shared: {OPTIMISTIC}", flush=True)
    with identity_lock(resolve_path(cfg.cv.work_dir),
                       f"tune-{cfg.model.name}-{cfg.data.name}-{cfg.protocol.name}-{cfg.task.name}"):
        base = plan_cv(cfg, client, tracking_uri)
        plan = TunedPlan(**{f.name: getattr(base, f.name) for f in fields(base)})
        cv_run = client.get_run(plan.parent_run_id)
        scope_label = f"{cfg.tune.trials} trials {'shared, OPTIMISTIC' if optimistic else 'per fold'}"
        for key, value in {**budget_tags(cfg, space), tracking.TUNE_BUDGET_TAGS[0]: str(cfg.tune.trials)}.items():
            client.set_tag(plan.parent_run_id, key, value)
        if optimistic:
            client.set_tag(plan.parent_run_id, tracking.TUNE_NOTE_TAG, OPTIMISTIC)
        if "tuned" not in cv_run.info.run_name:
            client.update_run(plan.parent_run_id, name=f"{cv_run.info.run_name} tuned ({scope_label})")
        if plan.finished:
            print(f"tuned cross-validation {plan.parent_run_id} already finished with these settings")
            return dict(client.get_run(plan.parent_run_id).data.metrics)
        key = search_key(cfg, space, cv_run.data.tags["fold_file_sha256"], plan.decisions)
        names = study_names(key, cfg.tune.scope, plan.fold_ids)
        storage_file = storage_path(cfg, key)
        tuning = cv_runs.tuning_run_of(client, plan.experiment_id, plan.parent_run_id)
        if tuning is None:
            tuning = client.create_run(plan.experiment_id, run_name=f"search {cfg.model.name} {cfg.task.name} "
                                       f"({scope_label})", tags={
                                           **{k: cv_run.data.tags.get(k, "") for k in
                                              ("model", "dataset", "protocol", "task", "subject_set", "seed")},
                                           **budget_tags(cfg, space), tracking.RUN_KIND_TAG: tracking.TUNING_RUN,
                                           tracking.TUNED_CV_RUN_TAG: plan.parent_run_id,
                                           tracking.STUDY_STORAGE_TAG: str(storage_file),
                                           tracking.SEARCH_SPACE_TAG: space.source,
                                           **({tracking.TUNE_NOTE_TAG: OPTIMISTIC} if optimistic else {})})
            client.log_text(tuning.info.run_id, OmegaConf.to_yaml(cfg), "config.yaml")
        else:
            client.update_run(tuning.info.run_id, status="RUNNING")
        for run in cv_runs.running_children(client, plan.experiment_id, tuning.info.run_id):
            client.set_terminated(run.info.run_id, "KILLED")  # trial runs of a stopped worker
        client.set_tag(plan.parent_run_id, tracking.TUNING_RUN_TAG, tuning.info.run_id)
        print(f"search: {len(names)} stud{'y' if len(names) == 1 else 'ies'} of {cfg.tune.trials} trials "
              f"({cfg.tune.scope}), space {space.source} ({len(space.parameters)} parameters), storage "
              f"{storage_file}; tuning run {tuning.info.run_id}; live view: optuna-dashboard {storage_file}",
              flush=True)
        studies = prepare_studies(cfg, storage_file, names, space)
        worker = TuneWorker(OmegaConf.to_container(cfg, resolve=True), names, list(plan.fold_ids), str(storage_file),
                            tuning.info.run_id, tracking_uri, str(plan.work_dir / "tuning"),
                            asdict(plan.decisions))
        Path(worker.work_dir).mkdir(parents=True, exist_ok=True)
        try:
            launch_workers(cfg, worker, client, plan.experiment_id)
        except BaseException:
            client.set_terminated(tuning.info.run_id, "KILLED")
            client.set_terminated(plan.parent_run_id, "KILLED")
            raise
        storage = open_storage(storage_file)
        studies = {name: optuna.load_study(study_name=name, storage=storage) for name, _ in names}
        short = {name: len(finished_trials(study)) for name, study in studies.items()
                 if len(finished_trials(study)) < cfg.tune.trials}
        if short:
            client.set_terminated(tuning.info.run_id, "FAILED")
            raise TuneError(f"studies without {cfg.tune.trials} finished trials: {short}; run the same command "
                            f"again to continue them")
        chosen = choose(studies, names, plan.fold_ids)
        log_search(client, tuning.info.run_id, studies, chosen, cfg.tune.scope)
        client.set_terminated(tuning.info.run_id, tracking.FINISHED)
        for fold, entry in sorted(chosen.items()):
            print(f"fold {fold}: trial {entry['trial']} (validation {entry['value']:.4f}"
                  f"{', the default settings' if entry['default_trial'] else ''}): {entry['params']}", flush=True)
        plan.fold_params = {fold: entry["params"] for fold, entry in chosen.items()}
        client.log_text(plan.parent_run_id, json.dumps({str(k): v for k, v in chosen.items()}, indent=2,
                                                       default=str), CHOSEN_ARTIFACT)
        outcome = launch(plan, client)
        if outcome.failed or outcome.submitted:
            client.set_terminated(plan.parent_run_id, "FAILED" if outcome.failed else "RUNNING")
            unfinished = ", ".join(sorted(map(str, {**outcome.failed, **outcome.submitted})))
            raise TuneError(f"tuned fold(s) {unfinished} did not finish; run the same command again to continue")
        summary = aggregate(plan, client)
        if optimistic:
            print(f"note: these test scores are {OPTIMISTIC}")
        print(f"tuned CV parent run {plan.parent_run_id}, search run {tuning.info.run_id}")
        return summary
