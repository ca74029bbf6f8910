"""`make tune`: hyper-parameter search with Optuna inside the leave-subjects-out folds, then the tuned CV.

search -> choose -> cross-validate:
- **search**: one Optuna study per outer fold (`tune.scope=per_fold`, the default). A trial is a fold job with other
  settings: the CV's training path (`fold_job.train`, a two-stage head's second stage included), on a DataModule
  whose test split is the fold's validation subjects (`SubjectRoles.validation_as_test`), so the fold's test subjects
  are never read by the study: not as the objective (the best validation score of what the CV would keep: a
  two-stage head's), not as the pruning signal (each epoch's validation score of the fitted network; a frozen
  backbone's two-stage head has no such epochs and is not pruned), not as the stopping rule. `tune.scope=shared`
  runs one study whose trial trains every fold and scores the mean validation score over folds: each fold's chosen
  settings then depend on models trained on its test subjects, so it is OPTIMISTIC, and every run, tag and line it
  prints says so. The space searched is `search_space`'s (`configs/tune/spaces/`).
- **choose**: each fold's best trial (or the shared study's best for every fold), written on the tuning run.
- **cross-validate**: the usual CV (`plan_cv`, `launch`, `aggregate`), each fold's job carrying its chosen settings;
  its parent is a CV run tagged as tuned, with the budget (trials, scope, search-space hash) `make compare` matches.

Studies live in an Optuna journal file under `tune.storage_dir` (`studies`: next to the CV work folder; on shared disk
a journal serves many workers). A killed search rerun continues: finished trials are kept, a trial left RUNNING by a
dead worker is marked FAIL and its parameters are enqueued again. Workers (`search_workers`) are `python -m pipeline
tune-worker <spec.json>` processes (`launcher=parallel`) or SLURM array tasks (`launcher=slurm`), each asking the
shared studies for trials.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from mlflow import MlflowClient
from omegaconf import DictConfig, OmegaConf

from pipeline.runs.jobs.fold_decisions import FoldDecisions
from pipeline.runs.jobs.fold_run import FoldJob
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.cross_validation import (
    Plan,
    aggregate,
    driver_description,
    identity_lock,
    launch,
    plan_cv,
)
from pipeline.runs.orchestration.cv_settings import CvRunSettings
from pipeline.runs.orchestration.search_space import SearchSpace, TuneError, load_space, with_params
from pipeline.runs.orchestration.search_workers import TuneWorker, launch_workers
from pipeline.runs.orchestration.studies import (
    TuneSettings,
    finished_trials,
    open_storage,
    prepare_studies,
    storage_path,
)
from pipeline.runs.store import cv_runs, tracking
from pipeline.runs.store.cv_runs import identity_config
from pipeline.utils.accelerator import announce_device
from pipeline.utils.atomic_io import atomic_write_text, save_png

log = logging.getLogger(__name__)
SCOPES = ("per_fold", "shared")
OPTIMISTIC = "OPTIMISTIC (shared study: each fold's settings were chosen with models that trained on its test subjects)"
CHOSEN_ARTIFACT = "chosen_params.json"


@dataclass
class TunedPlan(Plan):
    """A cross-validation plan whose fold jobs carry each fold's chosen settings."""

    fold_params: dict[int, dict[str, Any]] = field(default_factory=dict)

    def job(self, fold: int, tracking_uri: str | None = None, seed: int | None = None) -> FoldJob:
        job = super().job(fold, tracking_uri, seed)
        return replace(job, config=with_params(job.config, self.fold_params[int(fold)]))


def search_key(cv: cv_runs.CvConfig, space: SearchSpace, fold_file_sha256: str, decisions: FoldDecisions) -> str:
    """What makes two searches the same study: the settings (without the trial budget, so a rerun with more trials
    continues the study), the search space, the fold file and the starting weights by what they are (the plan's
    SHA-256, or `random`), not by where the file lies: a file changed in place is another study, the same file
    moved is the same one."""
    config = identity_config(cv)
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


def budget_tags(tune: TuneSettings, space: SearchSpace) -> dict[str, str]:
    trials, scope, space_hash = tracking.TUNE_BUDGET_TAGS
    return {tracking.TUNED_TAG: "true", trials: str(tune.trials), scope: tune.scope, space_hash: space.sha256[:16]}


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


def run_tune(cfg: DictConfig) -> dict:
    """Search per fold (or shared), choose, then cross-validate with the chosen settings; returns the tuned CV's
    aggregate metrics (empty when it could not finish)."""
    tune = TuneSettings.from_config(cfg)  # the search's settings, read once
    if tune.scope not in SCOPES:
        raise TuneError(f"unknown tune.scope {tune.scope!r}; known: {', '.join(SCOPES)}")
    run = CvRunSettings.from_config(cfg)  # the tuned CV's settings, read once
    space = load_space(tune.space, tune.model, WhatTrains.of(run.training), run.training.config)
    space.defaults(run.training.config)  # a default outside its range fails before any data or training
    tracking_uri = tracking.store_uri(cfg.mlflow.tracking_uri)
    launchers.check_launcher(cfg.launcher.name, tracking_uri)
    client = MlflowClient(tracking_uri)
    if cfg.launcher.name != "slurm":  # said first; on SLURM each node says its own
        announce_device(cfg.trainer.accelerator)
    if tune.scope == "shared":
        print(f"tune.scope=shared: {OPTIMISTIC}", flush=True)
    with identity_lock(run.work_dir, cv_runs.run_key(run.cv, tracking_uri, "tune"),
                       driver_description("make tune", run, tracking_uri)):
        plan = tuned_plan(run, tune, client, tracking_uri, space)
        if plan.finished:
            print(f"tuned cross-validation {plan.parent_run_id} already finished with these settings")
            return dict(client.get_run(plan.parent_run_id).data.metrics)
        fold_file_sha256 = client.get_run(plan.parent_run_id).data.tags[tracking.FOLD_FILE_TAG]
        key = search_key(run.cv, space, fold_file_sha256, plan.decisions)
        tuning_run_id = open_tuning_run(tune, run.training.config, client, plan, space, storage_path(tune, key))
        chosen = search(tune, client, plan, space, key, tuning_run_id)
        plan.fold_params = {fold: entry["params"] for fold, entry in chosen.items()}
        client.log_text(plan.parent_run_id, json.dumps({str(k): v for k, v in chosen.items()}, indent=2,
                                                       default=str), CHOSEN_ARTIFACT)
        summary = cross_validate(plan, tune, client)
        print(f"tuned CV parent run {plan.parent_run_id}, search run {tuning_run_id}")
        return summary


def scope_label(tune: TuneSettings) -> str:
    return f"{tune.trials} trials {'shared, OPTIMISTIC' if tune.scope == 'shared' else 'per fold'}"


def tuned_plan(run: CvRunSettings, tune: TuneSettings, client: MlflowClient, tracking_uri: str,
               space: SearchSpace) -> TunedPlan:
    """The CV's plan (`plan_cv`) as a tuned one: its parent run tagged with the search budget (and OPTIMISTIC for a
    shared study) and named as tuned."""
    base = plan_cv(run, client, tracking_uri)
    plan = TunedPlan(**{f.name: getattr(base, f.name) for f in fields(base)})
    for key, value in {**budget_tags(tune, space), tracking.TUNE_BUDGET_TAGS[0]: str(tune.trials)}.items():
        client.set_tag(plan.parent_run_id, key, value)
    if tune.scope == "shared":
        client.set_tag(plan.parent_run_id, tracking.TUNE_NOTE_TAG, OPTIMISTIC)
    run_name = client.get_run(plan.parent_run_id).info.run_name
    if "tuned" not in run_name:
        client.update_run(plan.parent_run_id, name=f"{run_name} tuned ({scope_label(tune)})")
    return plan


def open_tuning_run(tune: TuneSettings, config: dict, client: MlflowClient, plan: TunedPlan, space: SearchSpace,
                    storage_file: Path) -> str:
    """The tuning run of the tuned CV (`cv_runs.tuning_run_of`), created with the search's tags and its resolved
    `config` if new, else RUNNING again with the trial runs a stopped worker left marked KILLED; tagged on the CV's
    parent."""
    cv_run = client.get_run(plan.parent_run_id)
    tuning = cv_runs.tuning_run_of(client, plan.experiment_id, plan.parent_run_id)
    if tuning is None:
        tags = {**tracking.inherited_tags(cv_run), **budget_tags(tune, space),
                tracking.RUN_KIND_TAG: tracking.TUNING_RUN,
                tracking.TUNED_CV_RUN_TAG: plan.parent_run_id, tracking.STUDY_STORAGE_TAG: str(storage_file),
                tracking.SEARCH_SPACE_TAG: space.source,
                **({tracking.TUNE_NOTE_TAG: OPTIMISTIC} if tune.scope == "shared" else {})}
        tuning = client.create_run(plan.experiment_id, tags=tags,
                                   run_name=f"search {tune.model} {tune.task} ({scope_label(tune)})")
        client.log_text(tuning.info.run_id, OmegaConf.to_yaml(config), "config.yaml")
    else:
        client.update_run(tuning.info.run_id, status=tracking.RUNNING)
    for run in cv_runs.running_children(client, plan.experiment_id, tuning.info.run_id):
        client.set_terminated(run.info.run_id, tracking.KILLED)  # trial runs of a stopped worker
    client.set_tag(plan.parent_run_id, tracking.TUNING_RUN_TAG, tuning.info.run_id)
    return tuning.info.run_id


def search(tune: TuneSettings, client: MlflowClient, plan: TunedPlan, space: SearchSpace, key: str,
           tuning_run_id: str) -> dict[int, dict[str, Any]]:
    """The studies of the search `key` prepared, their trials run by the launcher's workers, and each fold's choice
    (`choose`) logged on the tuning run, which is then FINISHED; a study short of `tune.trials` finished trials is an
    error."""
    names, storage_file = study_names(key, tune.scope, plan.fold_ids), storage_path(tune, key)
    print(f"search: {len(names)} stud{'y' if len(names) == 1 else 'ies'} of {tune.trials} trials "
          f"({tune.scope}), space {space.source} ({len(space.parameters)} parameters), storage "
          f"{storage_file}; tuning run {tuning_run_id}; live view: optuna-dashboard {storage_file}", flush=True)
    prepare_studies(tune, storage_file, names, space.defaults(plan.config))
    worker = TuneWorker(plan.config, names, list(plan.fold_ids), str(storage_file),
                        tuning_run_id, plan.tracking_uri, str(plan.work_dir / "tuning"), asdict(plan.decisions))
    Path(worker.work_dir).mkdir(parents=True, exist_ok=True)
    with (tracking.run_lifecycle(tuning_run_id, client, finish=False),
          tracking.run_lifecycle(plan.parent_run_id, client, finish=False)):
        launch_workers(plan.launcher, tune.model, worker, client, plan.experiment_id)
    storage = open_storage(storage_file)
    studies = {name: optuna.load_study(study_name=name, storage=storage) for name, _ in names}
    short = {name: len(finished_trials(study)) for name, study in studies.items()
             if len(finished_trials(study)) < tune.trials}
    if short:
        client.set_terminated(tuning_run_id, tracking.FAILED)
        raise TuneError(f"studies without {tune.trials} finished trials: {short}; run the same command "
                        f"again to continue them")
    chosen = choose(studies, names, plan.fold_ids)
    log_search(client, tuning_run_id, studies, chosen, tune.scope)
    client.set_terminated(tuning_run_id, tracking.FINISHED)
    for fold, entry in sorted(chosen.items()):
        print(f"fold {fold}: trial {entry['trial']} (validation {entry['value']:.4f}"
              f"{', the default settings' if entry['default_trial'] else ''}): {entry['params']}", flush=True)
    return chosen


def cross_validate(plan: TunedPlan, tune: TuneSettings, client: MlflowClient) -> dict:
    """The tuned CV: its folds launched with their chosen settings, then aggregated; folds that did not finish are
    an error that says to run the command again."""
    with launchers.LaunchSession() as session:
        outcome = launch(plan, client, session)
    if outcome.failed or outcome.submitted:
        client.set_terminated(plan.parent_run_id, tracking.FAILED if outcome.failed else tracking.RUNNING)
        unfinished = ", ".join(sorted(map(str, {**outcome.failed, **outcome.submitted})))
        raise TuneError(f"tuned fold(s) {unfinished} did not finish; run the same command again to continue")
    summary = aggregate(plan, client)
    if tune.scope == "shared":
        print(f"note: these test scores are {OPTIMISTIC}")
    return summary
