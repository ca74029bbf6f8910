"""`make final`: one model trained on all subjects with the settings of a backbone's latest finished CV, logged as an
MLflow Model and registered as `pain-<model>-<task>` (alias `candidate`).

The CV said how well these settings do on unseen people; the final model uses them on everybody. Its config is the
CV's own `config.yaml` (only where and how it runs comes from the current command), and the CV's parent run is
recorded as its source. A seeded, stratified share of whole subjects (`final.val_fraction`) is held out: early
stopping and checkpoint selection read it, as in a fold, and the decision threshold is chosen on its videos with the
evaluation rule (`eval.threshold`) by the function a fold uses (`thresholds.video_threshold`).

Design: the final model is a fold whose test subjects are its validation subjects. Its split file has train and val
roles only (a fold file needs a test role, and these subjects must not be tested on twice under two names), and its
roles (`final_roles`: the validation subjects standing in as the test split) are handed to the one DataModule, so
`build_fold` and the fold's training path (epoch checkpoints, resume from `last.ckpt`, the best checkpoint scored
on those frames for the threshold) run unchanged.
Resume works as for a fold: the work folder is named after the source CV and the final settings, a run left RUNNING
by a killed attempt is marked KILLED, and the next attempt continues from the last epoch checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Param
from omegaconf import DictConfig, OmegaConf

from pipeline.data.datamodule import SubjectRoles
from pipeline.data.fold_files import read_folds, stratified_sample, subject_strata
from pipeline.evaluation.thresholds import binary_metrics_at, threshold_scores, video_threshold
from pipeline.models.model_file import MODEL_ARTIFACT
from pipeline.runs.jobs.fold_decisions import plan_decisions, settings_here
from pipeline.runs.jobs.fold_job import build_fold, train
from pipeline.runs.jobs.head_modes import head_mode
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.serving.mlflow_model import log_mlflow_model, model_config
from pipeline.runs.store import cv_runs, tracking
from pipeline.runs.store.cv_runs import CvNotFound
from pipeline.runs.store.registry import (
    describe_run,
    register,
    registered_name,
    run_url,
    split_videos,
    standard_tags,
    subjects_dataset,
)
from pipeline.utils.accelerator import announce_device
from pipeline.utils.atomic_io import atomic_write_csv
from pipeline.utils.paths import git_commit, resolve_path

log = logging.getLogger(__name__)
# Where and how a run happens, not what it learns: taken from the current command, not from the source CV.
RUNTIME_KEYS = ("launcher", "mlflow", "cv", "reports_dir", "final", "predict")
SPLIT_FILE = "final_split.csv"


def final_roles(split_path: Path) -> SubjectRoles:
    """The final model's subject roles: train and val from its split file (`subject_name, role`), the val subjects
    again as the test split (the threshold is chosen on them)."""
    split = read_split(split_path)
    train, val = (tuple(sorted(split.loc[split["role"] == role, "subject_name"])) for role in ("train", "val"))
    return SubjectRoles(train, val, val, 0, str(split_path))


def read_split(path: Path) -> pd.DataFrame:
    """A final split file: every subject once, roles train and val, both present."""
    split = pd.read_csv(path, dtype=str, keep_default_na=False)
    if list(split.columns) != ["subject_name", "role"]:
        raise ValueError(f"{path}: expected columns subject_name, role; found {list(split.columns)}")
    bad = split.index[~split["role"].isin(["train", "val"])]
    if len(bad):
        raise ValueError(f"{path}, data row {bad[0] + 1}: role {split['role'].iloc[bad[0]]!r} (expected train or val)")
    twice = split["subject_name"][split["subject_name"].duplicated()]
    if len(twice):
        raise ValueError(f"{path}: subject {twice.iloc[0]!r} is listed twice")
    if split["role"].nunique() != 2:
        raise ValueError(f"{path}: needs train and val subjects")
    return split


def make_split(subjects: list[str], val_fraction: float, seed: int) -> pd.DataFrame:
    """Whole subjects, a stratified seeded share of them val (at least one, at least one left to train)."""
    names = sorted(subjects)
    if len(names) < 2:
        raise ValueError(f"the final model needs at least 2 subjects (train and val), got {len(names)}")
    n_val = min(max(1, round(val_fraction * len(names))), len(names) - 1)
    val = set(stratified_sample(names, n_val, subject_strata(names), np.random.default_rng(seed)))
    return pd.DataFrame({"subject_name": names, "role": ["val" if n in val else "train" for n in names]})


def training_config(current: dict, client: MlflowClient, source_run_id: str) -> DictConfig:
    """The source CV's resolved config, with the runtime settings (`RUNTIME_KEYS`) of the current command's resolved
    config (`current`)."""
    path = client.download_artifacts(source_run_id, "config.yaml")
    trained = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    for key in RUNTIME_KEYS:
        if key in current:
            trained[key] = current[key]
    for key in ("workers", "device"):
        trained.setdefault("preprocess", {})[key] = current["preprocess"][key]
    # the evaluation rule of the source CV, else the current config's (a CV from before the setting existed)
    if trained.get("eval", {}).get("threshold") is None:
        trained.setdefault("eval", {})["threshold"] = current["eval"]["threshold"]
    return OmegaConf.create(trained)


def final_key(source_run_id: str, val_fraction: float, seed: int) -> str:
    text = json.dumps({"source": source_run_id, "val_fraction": val_fraction, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def refuse_unservable(ensemble: bool, training: TrainingSettings, source_id: str) -> None:
    """A fold ensemble (`ensemble`: final.ensemble) that could not be scored is refused before anything trains: of
    clip models, or of a personalised CV's models (each scores a person against their own reference, one network at
    a time). A personalised final model itself is kept: `make predict REFERENCE=` scores with it."""
    head, protocol = training.head, training.personalise
    mode = head_mode(head)
    if ensemble and protocol.personal:
        raise SystemExit(f"final.ensemble=true: CV {source_id} is personalised ({protocol.label}), and a fold "
                         f"ensemble of personalised models is not supported; drop final.ensemble")
    if ensemble and mode.keeps_clip_model:  # said before anything trains, not after the final model
        raise SystemExit(f"final.ensemble=true: CV {source_id} trained clip models ({head.label}), and a fold "
                         f"ensemble of clip models is not supported (each member would need its own window of its own "
                         f"embeddings); drop final.ensemble")


def run_final(cfg: DictConfig, run: str | None = None) -> dict:
    """`make final [RUN=<CV parent run>]`; returns the final run's id, metrics, threshold and registered version."""
    announce_device(cfg.trainer.accelerator)  # said first; a GPU asked for and not usable stops here
    tracking_uri = tracking.store_uri(cfg.mlflow.tracking_uri)
    client = MlflowClient(tracking_uri)
    try:
        source = cv_runs.source_cv(client, cv_runs.CvConfig.from_config(cfg), run)
    except CvNotFound as error:
        raise SystemExit(f"final: {error}") from None
    source_id = source.info.run_id
    train_cfg = training_config(OmegaConf.to_container(cfg, resolve=True), client, source_id)
    training = TrainingSettings.from_config(train_cfg)  # what trains, read once from the CV's config
    refuse_unservable(bool(cfg.final.ensemble), training, source_id)
    fold_file = resolve_path(train_cfg.fold_file)
    subjects = sorted(set(read_folds(fold_file)["subject_name"]))
    key = final_key(source_id, float(cfg.final.val_fraction), int(cfg.final.seed))
    work_dir = resolve_path(cfg.cv.work_dir) / "final" / key
    previous = cv_runs.final_runs(client, source.info.experiment_id, key)
    finished = [r for r in previous if r.info.status == tracking.FINISHED]
    if finished and cfg.cv.resume == "auto":
        done = finished[0]
        print(f"final model of {source.info.run_name!r} already trained: run {done.info.run_id}, registered "
              f"{done.data.tags.get(tracking.REGISTERED_MODEL_TAG, '-')} version "
              f"{done.data.tags.get(tracking.REGISTERED_VERSION_TAG, '-')} (RESUME=never trains a new one)")
        return {"run_id": done.info.run_id, "metrics": dict(done.data.metrics),
                "version": done.data.tags.get(tracking.REGISTERED_VERSION_TAG)}
    if cfg.cv.resume == "never":
        shutil.rmtree(work_dir, ignore_errors=True)
    for old in previous:
        if old.info.status == tracking.RUNNING:  # a killed attempt: this one replaces it and continues its checkpoint
            client.set_terminated(old.info.run_id, tracking.KILLED)
    work_dir.mkdir(parents=True, exist_ok=True)
    split_path = work_dir / SPLIT_FILE
    if not split_path.is_file():
        atomic_write_csv(split_path, make_split(subjects, float(cfg.final.val_fraction), int(cfg.final.seed)))
    split = read_split(split_path)
    tags = tracking.inherited_tags(source, (*tracking.INHERITED_TAGS, tracking.FOLD_FILE_TAG,
                                            tracking.WEIGHTS_SOURCE_TAG))
    tags.update({tracking.RUN_KIND_TAG: tracking.FINAL_RUN, tracking.FINAL_KEY_TAG: key,
                 tracking.SOURCE_CV_RUN_TAG: source_id, tracking.ATTEMPT_TAG: str(len(previous) + 1),
                 **standard_tags("make final")})
    model_name, task = train_cfg.model.name, train_cfg.task.name
    mlflow.set_tracking_uri(tracking_uri)
    active = mlflow.start_run(experiment_id=source.info.experiment_id, run_name=f"final {model_name} "
                              f"{train_cfg.data.name} {task}", tags=tags)
    run_id = active.info.run_id
    print(f"final model: {model_name} on all {len(subjects)} subjects ({(split.role == 'val').sum()} held out for "
          f"early stopping and the threshold), settings of CV {source.info.run_name!r} ({source_id})")
    with tracking.run_lifecycle(run_id, client):
        result = train_final(training, cv_runs.identity_params(cv_runs.CvConfig.from_config(train_cfg)),
                             bool(cfg.final.ensemble), client, run_id, source, split_path, work_dir)
    shutil.rmtree(work_dir, ignore_errors=True)
    url = run_url(tracking_uri, source.info.experiment_id, run_id)
    print(f"final run {run_id}: {url}")
    print(f"registered {result['name']} version {result['version']} (alias candidate); "
          f"`make promote MODEL={model_name} VERSION={result['version']}` makes it the champion")
    return {"run_id": run_id, **result}


def train_final(training: TrainingSettings, params: dict[str, str], ensemble: bool, client: MlflowClient, run_id: str,
                source, split_path: Path, work_dir: Path) -> dict:
    """Train, choose the threshold, keep and log the model, register it (and the fold ensemble where `ensemble`);
    inside the active final run, which logs `params` (the CV's identity parameters) and the CV's config."""
    for chunk in cv_runs.chunks(list(params.items()), 100):
        client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
    mlflow.log_text(OmegaConf.to_yaml(training.config), "config.yaml")
    mlflow.log_artifact(str(split_path))
    decisions = plan_decisions(training, split_path)  # the weights and backbone family, decided once here too
    # precision and channels_last: this machine's device decides
    settings = settings_here(decisions, training.trainer.channels_last, training.trainer.accelerator)
    print(settings.line)
    mlflow.set_tags(tracking.device_settings_tags(settings))
    built = build_fold(training, WhatTrains.of(training).check(), final_roles(split_path), decisions, settings)
    module, datamodule, weights = built.module, built.datamodule, built.weights
    used = split_videos(datamodule, ("train", "val"))
    mlflow.log_input(subjects_dataset(used, f"{training.dataset}-{training.task.name}-final"), context="training")
    # the fold's path: its test split is the held-out validation subjects, scored once (a two-stage head on them too)
    result = train(training, built, work_dir, settings, scored=("test",))
    evaluation = result.held_out
    best_epoch, epochs_trained, best_score = result.best_epoch, result.epochs_trained, float(result.best_score)
    class_names = list(module.class_names)
    videos = evaluation.video_predictions
    rule = training.threshold_rule
    threshold = video_threshold(videos, class_names, rule).threshold  # as a fold chooses it, on the held-out videos
    at = binary_metrics_at(*threshold_scores(videos, class_names), threshold)
    metrics = {**evaluation.metrics(prefix="val/"), **{f"val/video_{k}_at_threshold": v for k, v in at.items()},
               "threshold": threshold, "best_epoch": best_epoch, "epochs_trained": epochs_trained,
               "best_val_score": best_score}
    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if np.isfinite(v)})
    with tempfile.TemporaryDirectory() as tmp:
        videos.to_csv(Path(tmp) / "predictions_val_videos.csv", index=False)
        mlflow.log_artifact(str(Path(tmp) / "predictions_val_videos.csv"))
    kept = {"final": True, "best_epoch": best_epoch, "threshold": threshold, "source_cv_run": source.info.run_id}
    model_path = built.mode.keep(training, built, result, work_dir / "model.pt", **kept)
    mlflow.log_artifact(str(model_path), "model")
    name, version, info = register_final(training, client, run_id, source.info.run_id, model_path, weights,
                                         model_config(training.config, class_names, threshold, rule))
    table = pd.DataFrame([{"subjects (train / val)": f"{(datamodule.split_summary()['train']['subjects'])} / "
                                                     f"{datamodule.split_summary()['val']['subjects']}",
                           "val video AUROC": metrics.get("val/video_auroc", float("nan")),
                           "threshold": threshold, "rule": str(rule),
                           "val bal-acc at threshold": at["balanced_accuracy"],
                           "best epoch": best_epoch}])
    describe_run(client, run_id, f"Final {training.model_name} model, {training.task.name}", table,
                 [f"Trained on all subjects with the settings of CV run `{source.info.run_id}` "
                  f"({source.info.run_name}). Registered as `{name}` version {version.version} (alias `candidate`).",
                  "The validation numbers come from the subjects that chose the checkpoint and the threshold: "
                  "optimistic. The CV's scores are the estimate for new people."])
    if ensemble:
        members = log_fold_ensemble(client, training, source, run_id, class_names)
        mlflow.set_tag(tracking.ENSEMBLE_VERSION_TAG, members)
        print(f"fold ensemble registered as {name}-folds version {members} (alias candidate)")
    print(f"val video AUROC {metrics.get('val/video_auroc', float('nan')):.3f}, threshold {threshold:.3f} ({rule}), "
          f"best epoch {best_epoch} of {epochs_trained}")
    return {"metrics": metrics, "threshold": threshold, "name": name, "version": str(version.version),
            "model_uri": info.model_uri}


def register_final(training: TrainingSettings, client: MlflowClient, run_id: str, source_id: str, model_path: Path,
                   weights: dict, config: dict) -> tuple[str, Any, Any]:
    """The kept final model as an MLflow model of the active final run (`config`: its `model_config`), registered as
    `pain-<model>-<task>` (alias candidate) with its description; returns the name, the version and the ModelInfo."""
    name = registered_name(training.model_name, training.task.name)
    metadata = {"source_cv_run": source_id, "final_run": run_id, "git_commit": git_commit(),
                "model": training.model_name, "task": training.task.name, "dataset": training.dataset,
                **{f"weights_{k.removeprefix('weights_')}": v for k, v in weights.items()}}
    personal = training.personalise.personal
    info = log_mlflow_model(model_path, config, metadata,
                            tags={tracking.MODEL_KIND_TAG: tracking.FINAL_MODEL, tracking.SOURCE_CV_RUN_TAG: source_id},
                            with_example=not personal)  # a personalised model scores nobody without a reference
    threshold, rule = config["threshold"], config["threshold_rule"]
    version = register(client, info.model_uri, name, run_id, tags={tracking.VERSION_SOURCE_CV_TAG: source_id,
                                                                   tracking.VERSION_THRESHOLD_TAG: f"{threshold:.4f}"})
    client.update_model_version(name, version.version, description=(
        f"{training.model_name}, {training.task.name}: trained on all subjects of {training.dataset} with the "
        f"settings of CV run {source_id}; threshold {threshold:.3f} ({rule}) on the held-out validation "
        f"subjects; final run {run_id}."))
    mlflow.set_tags({tracking.REGISTERED_MODEL_TAG: name, tracking.REGISTERED_VERSION_TAG: str(version.version)})
    return name, version, info


def log_fold_ensemble(client: MlflowClient, training: TrainingSettings, source, run_id: str,
                      class_names: list[str]) -> str:
    """The source CV's kept fold models as one MLflow model that averages their probabilities, logged in the final
    run and registered as `pain-<model>-<task>-folds` (alias `candidate`). Its threshold is 0.5: no subjects were
    held out from all folds to choose one on."""
    runs = tracking.finished_fold_runs(client, source.info.run_id)
    kept = {fold: r for fold, r in runs.items()
            if any(a.path == MODEL_ARTIFACT for a in client.list_artifacts(r.info.run_id, "model"))}
    if not kept:
        raise SystemExit(f"final.ensemble: CV run {source.info.run_id} kept no fold models (cv.log_models=false)")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(client.download_artifacts(r.info.run_id, MODEL_ARTIFACT, str(Path(tmp) / f"fold_{fold}")))
                 for fold, r in sorted(kept.items())]
        metadata = {"source_cv_run": source.info.run_id, "final_run": run_id, "folds": sorted(kept),
                    "git_commit": git_commit(), "model": training.model_name, "task": training.task.name}
        info = log_mlflow_model(paths[0], model_config(training.config, class_names, 0.5, 0.5), metadata,
                              name="fold_ensemble", tags={tracking.MODEL_KIND_TAG: tracking.ENSEMBLE_MODEL},
                              ensemble_paths=paths[1:])
    name = f"{registered_name(training.model_name, training.task.name)}-folds"
    version = register(client, info.model_uri, name, run_id,
                       tags={tracking.VERSION_SOURCE_CV_TAG: source.info.run_id,
                             tracking.VERSION_FOLDS_TAG: ",".join(map(str, sorted(kept)))})
    return str(version.version)
