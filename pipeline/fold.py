"""One fold of a cross-validation as a job that can run anywhere: this process, another process, a SLURM node.

A `FoldJob` holds plain values only (the resolved config, the fold id, the parent run id, the tracking URI and a
work folder), so it pickles for submitit and writes as JSON for a subprocess. `run_fold_job` is idempotent: a fold
that already has a FINISHED child run is not trained again, a child run left RUNNING by a killed attempt is marked
KILLED, and training continues from the fold's last epoch checkpoint when one exists.

The steps, each a function: `build_fold` (model, data, LightningModule), `fit_fold` (train, select on the inner
validation subjects, epoch checkpoints), `test_fold` (the best checkpoint, scored once on the test subjects),
`write_fold_artifacts` (plots and tables), `keep_fold_model` (the self-describing model file).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from mlflow import MlflowClient
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.plugins.io import TorchCheckpointIO

from pipeline import resolve_path
from pipeline.backbones import create_model
from pipeline.checkpoints import MODEL_ARTIFACT, model_meta, save_fold_model
from pipeline.datamodule import PainDataModule
from pipeline.devices import precision_for, use_channels_last
from pipeline.io import atomic_path
from pipeline.metrics import Evaluation, plot_confusion, plot_roc, plot_training_curves
from pipeline.module import FreezeBackbone, OptimConfig, PainClassifier
from pipeline.tasks import get_task

log = logging.getLogger(__name__)
FRAME_PREDICTIONS = "predictions_frames.csv"
VIDEO_PREDICTIONS = "predictions_videos.csv"


@dataclass(frozen=True)
class FoldJob:
    """Everything a fold needs, as plain values."""

    config: dict  # the resolved config (OmegaConf.to_container)
    fold: int
    parent_run_id: str
    tracking_uri: str
    work_dir: str  # the fold's own folder: epoch checkpoints (for resuming) and the kept model before upload

    def write(self, path: Path) -> Path:
        with atomic_path(path, mode=0o600) as tmp:  # owner only: the tracking URI may hold a database password
            tmp.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> FoldJob:
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class FoldResult:
    """A trained and tested fold: its test metrics and predictions (per crop and per video)."""

    fold: int
    metrics: dict[str, float]  # test/<level>_<metric>, best_epoch, epochs_trained, best_val_score
    frame_predictions: pd.DataFrame
    video_predictions: pd.DataFrame
    seconds: float
    run_id: str = ""

    @property
    def epochs(self) -> int:
        return int(self.metrics["epochs_trained"])

    @property
    def best_epoch(self) -> int:
        return int(self.metrics["best_epoch"])


class MlflowEpochLogger(pl.Callback):
    """Logs each epoch's train/val metrics to the active MLflow run (step = epoch) and keeps them for the plot.

    Hooked on the end of the training epoch: by then the epoch's validation has run and Lightning has reduced the
    epoch-level train metrics. Its history is saved in the epoch checkpoint, and a resumed fold logs it again to
    its new child run, so the curves there start at epoch 0.
    """

    def __init__(self) -> None:
        self.history: list[dict] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.history:
            mlflow.set_tag("painvit.resumed_after_epoch", str(int(self.history[-1]["epoch"])))
        for row in self.history:
            mlflow.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=int(row["epoch"]))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if k.startswith(("train/", "val/")) and torch.numel(v) == 1}
        metrics["lr/head"] = trainer.optimizers[0].param_groups[-1]["lr"] if trainer.optimizers else float("nan")
        mlflow.log_metrics(metrics, step=trainer.current_epoch)
        self.history.append({"epoch": trainer.current_epoch, **metrics})

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict.get("history", []))


class LeaveSigtermToSubmitit(pl.Callback):
    """Under SLURM, submitit handles preemption: it ignores SIGTERM and, on the requeue signal, checkpoints and
    requeues the job. Lightning's own SIGTERM handler would end fit() at the next batch, before the requeue signal
    arrives, so the job would exit instead of being requeued; this puts submitit's handler back once fit runs."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original = trainer._signal_connector._original_handlers.get(signal.SIGTERM)
        if original is not None:
            signal.signal(signal.SIGTERM, original)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Epoch checkpoints written beside their target and renamed onto it: a job killed mid-write leaves the last
    complete checkpoint, never a truncated one."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)


def class_weights_for(setting, train_labels: np.ndarray, n_classes: int) -> list[float] | None:
    if setting is None:
        return None
    if setting == "balanced":
        counts = np.bincount(train_labels, minlength=n_classes).astype(float)
        return list(len(train_labels) / (n_classes * np.maximum(counts, 1)))
    weights = list(setting)
    if len(weights) != n_classes:
        raise ValueError(f"trainer.class_weights has {len(weights)} values for {n_classes} classes")
    return weights


def build_fold(cfg: DictConfig, fold: int, fold_file: Path,
               datamodule_class: type[PainDataModule] = PainDataModule) -> tuple[PainClassifier, PainDataModule, dict]:
    """A fresh model, the fold's data and the LightningModule; also the weights' provenance as tags.

    `datamodule_class` lets the final model (`pipeline.final`) read its train / validation split the same way."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = get_task(cfg.task.name)
    net, weights = create_model(cfg.model.name, n_classes=task.n_classes, pretrained=cfg.model.pretrained,
                                weights=cfg.model.weights, img_size=cfg.model.img_size)
    channels_last = use_channels_last(cfg.trainer.channels_last, cfg.model.name)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    datamodule = datamodule_class(
        resolve_path(cfg.data.processed_dir), fold_file, fold, task, net.backbone.data_config,
        OmegaConf.to_container(cfg.augment), batch_size=cfg.loader.batch_size,
        eval_batch_size=cfg.loader.eval_batch_size, num_workers=cfg.loader.num_workers,
        balanced_sampling=cfg.loader.balanced_sampling, seed=cfg.seed,
        frames_per_video=cfg.loader.frames_per_video, crop_fraction=cfg.loader.crop_fraction,
        from_s=cfg.loader.from_s)
    datamodule.setup()
    train_labels = datamodule.frames("train")["label"].to_numpy()
    module = PainClassifier(
        net, task.classes, OptimConfig(**OmegaConf.to_container(cfg.model.optim)),
        label_smoothing=cfg.trainer.label_smoothing,
        class_weights=class_weights_for(cfg.trainer.class_weights, train_labels, task.n_classes),
        aggregation=cfg.trainer.aggregation, topk=cfg.trainer.topk, channels_last=channels_last,
        monitor=cfg.trainer.monitor)
    return module, datamodule, weights.as_tags()


@dataclass
class Fitted:
    trainer: pl.Trainer
    best_path: str
    best_epoch: int
    best_score: float
    history: list[dict]


def fit_fold(cfg: DictConfig, module: PainClassifier, datamodule: PainDataModule, work_dir: Path) -> Fitted:
    """Train with early stopping; select the best epoch on the inner validation subjects.

    Every epoch writes `last.ckpt` (full state) into work_dir; a fold that finds one there continues from it.
    """
    if cfg.trainer.devices != 1:
        raise ValueError("trainer.devices must be 1: video-level metrics are computed from one process's predictions")
    epoch_logger = MlflowEpochLogger()
    best = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="best", monitor=cfg.trainer.monitor,
                                        mode=cfg.trainer.monitor_mode, save_top_k=1, save_weights_only=True)
    # every epoch's full state, overwritten in place (Lightning's save_last only writes when another save happened)
    last = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="last", monitor=None, save_top_k=1,
                                        enable_version_counter=False)
    early_stopping = pl.callbacks.EarlyStopping(monitor=cfg.trainer.monitor, mode=cfg.trainer.monitor_mode,
                                                patience=cfg.trainer.patience)
    callbacks = [epoch_logger, best, last, early_stopping]
    if cfg.model.optim.freeze_backbone_epochs > 0:
        callbacks.append(FreezeBackbone(cfg.model.optim.freeze_backbone_epochs))
    plugins = [AtomicCheckpointIO()]
    if "SLURM_JOB_ID" in os.environ:  # submitit owns requeueing on SLURM; Lightning's own would requeue twice
        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(LeaveSigtermToSubmitit())
    limits = {k: cfg.trainer[k] for k in ("limit_train_batches", "limit_val_batches") if cfg.trainer[k] is not None}
    trainer = pl.Trainer(
        max_epochs=cfg.trainer.max_epochs, accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices,
        precision=precision_for(cfg.trainer.precision, cfg.trainer.accelerator, cfg.model.name),
        gradient_clip_val=cfg.trainer.gradient_clip_val, deterministic=cfg.trainer.deterministic,
        log_every_n_steps=cfg.trainer.log_every_n_steps, callbacks=callbacks, logger=False, plugins=plugins,
        default_root_dir=work_dir, enable_model_summary=False, num_sanity_val_steps=0,
        enable_progress_bar=sys.stderr.isatty(), **limits)  # a bar in a terminal, none in a job's log file
    resume_from = work_dir / "last.ckpt"
    if resume_from.is_file():
        log.warning("fold: continuing from the epoch checkpoint %s", resume_from)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from.is_file() else None)
    if not best.best_model_path:
        raise RuntimeError(f"no checkpoint was selected on {cfg.trainer.monitor} (was it logged?); "
                           f"refusing to test the last epoch's weights instead")
    best_score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    best_epoch = next((h["epoch"] for h in epoch_logger.history
                       if np.isclose(h.get(cfg.trainer.monitor, np.nan), best_score)), -1)
    return Fitted(trainer, best.best_model_path, best_epoch, best_score, epoch_logger.history)


def test_fold(fitted: Fitted, module: PainClassifier, datamodule: PainDataModule) -> tuple[pd.DataFrame, Evaluation]:
    """Score the best checkpoint once on the test subjects: per-crop predictions and their evaluation."""
    fitted.trainer.test(module, datamodule=datamodule, ckpt_path=fitted.best_path, verbose=False)
    return module.test_predictions, module.test_evaluation


def write_fold_artifacts(out: Path, fold: int, class_names: tuple[str, ...], predictions: pd.DataFrame,
                         evaluation: Evaluation, history: list[dict], splits: dict) -> None:
    """Plots and tables a person opens in the MLflow UI. Names and predictions only, never faces."""
    out.mkdir(parents=True, exist_ok=True)
    videos = evaluation.video_predictions
    plot_confusion(evaluation.confusion_video, class_names, out / "confusion_video.png", f"fold {fold}: videos")
    plot_confusion(evaluation.confusion_frame, class_names, out / "confusion_frame.png", f"fold {fold}: frames")
    if len(class_names) == 2 and videos["label"].nunique() == 2:
        plot_roc(videos["label"].to_numpy(), videos[f"prob_{class_names[1]}"].to_numpy(), out / "roc_video.png",
                 f"fold {fold}: video ROC")
    if history:
        plot_training_curves(pd.DataFrame(history), out / "training_curves.png")
    videos.to_csv(out / VIDEO_PREDICTIONS, index=False)
    predictions.drop(columns=["crop_path"], errors="ignore").to_csv(out / FRAME_PREDICTIONS, index=False)
    evaluation.per_subject.to_csv(out / "accuracy_per_subject.csv", index=False)
    (out / "splits.json").write_text(json.dumps(splits, indent=2, default=str))


def keep_fold_model(cfg: DictConfig, module: PainClassifier, best_path: str, weights: dict, path: Path,
                    **extra) -> Path:
    """The best checkpoint's network as a self-describing file (`pipeline.checkpoints`)."""
    state = torch.load(best_path, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state)
    meta = model_meta(module.model, model_name=cfg.model.name, img_size=cfg.model.img_size,
                      class_names=list(module.class_names), task=cfg.task.name,
                      loader=OmegaConf.to_container(cfg.loader), weights=weights, **extra)
    return save_fold_model(module.model, meta, path)


def train_fold(cfg: DictConfig, fold: int, fold_file: Path, work_dir: Path, keep_model: bool = False) -> FoldResult:
    """Train on the fold's training subjects, select on its validation subjects, test once on its test subjects.

    Logs epoch curves, test metrics and artifacts to the active MLflow run.
    """
    started = time.time()
    work_dir.mkdir(parents=True, exist_ok=True)
    module, datamodule, weights = build_fold(cfg, fold, fold_file)
    from pipeline.registry import split_videos, subjects_dataset

    mlflow.log_input(subjects_dataset(split_videos(datamodule), f"{cfg.data.name}-{cfg.task.name}-fold{fold}"),
                     context="training")
    fitted = fit_fold(cfg, module, datamodule, work_dir)
    predictions, evaluation = test_fold(fitted, module, datamodule)
    metrics = {**evaluation.metrics(prefix="test/"), "best_epoch": fitted.best_epoch,
               "epochs_trained": len(fitted.history), "best_val_score": fitted.best_score}
    out = work_dir / "artifacts"
    write_fold_artifacts(out, fold, module.class_names, predictions, evaluation, fitted.history,
                         datamodule.split_summary())
    mlflow.log_metrics(metrics)
    mlflow.log_artifacts(str(out))
    if keep_model:
        path = keep_fold_model(cfg, module, fitted.best_path, weights, work_dir / Path(MODEL_ARTIFACT).name,
                               fold=fold, best_epoch=fitted.best_epoch)
        mlflow.log_artifact(str(path), str(Path(MODEL_ARTIFACT).parent))
        from pipeline.pain_model import log_fold_model

        log_fold_model(cfg, path, fold, list(module.class_names), weights)
    return FoldResult(fold, metrics, predictions, evaluation.video_predictions, time.time() - started)


# ---------------------------------------------------------------------------------------------------------------
# The job: child-run bookkeeping around train_fold.

def fold_runs(client: MlflowClient, parent_run_id: str, fold: int | None = None) -> list:
    """The child runs of a cross-validation (of one fold), newest first."""
    parent = client.get_run(parent_run_id)
    query = f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.`painvit.run_kind` = 'fold'"
    if fold is not None:
        query += f" and tags.fold = '{fold}'"
    return client.search_runs([parent.info.experiment_id], query, order_by=["attribute.start_time DESC"],
                              max_results=10_000)


def result_from_run(client: MlflowClient, run) -> FoldResult:
    """A finished fold read back from its child run (metrics and prediction tables)."""
    run_id = run.info.run_id
    frames = pd.read_csv(client.download_artifacts(run_id, FRAME_PREDICTIONS))
    videos = pd.read_csv(client.download_artifacts(run_id, VIDEO_PREDICTIONS))
    seconds = ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000
    return FoldResult(int(run.data.tags["fold"]), dict(run.data.metrics), frames, videos, seconds, run_id)


def job_owner_tags() -> dict[str, str]:
    """Where a fold attempt runs: lets a later driver tell a live attempt from a dead one."""
    tags = {"painvit.host": socket.gethostname(), "painvit.pid": str(os.getpid())}
    if "SLURM_JOB_ID" in os.environ:
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        tags["painvit.slurm_job_id"] = f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]
    return tags


def run_fold_job(job: FoldJob) -> FoldResult:
    """Run one fold under its own child run of `job.parent_run_id`; see the module docstring for the rules."""
    client = MlflowClient(job.tracking_uri)
    previous = fold_runs(client, job.parent_run_id, job.fold)
    finished = [run for run in previous if run.info.status == "FINISHED"]
    if finished:
        log.info("fold %d already has a finished run %s", job.fold, finished[0].info.run_id)
        return result_from_run(client, finished[0])
    for run in previous:
        if run.info.status == "RUNNING":  # a killed attempt: this one replaces it
            client.set_terminated(run.info.run_id, "KILLED")
    cfg = OmegaConf.create(job.config)
    parent = client.get_run(job.parent_run_id)
    if cfg.model.pretrained == "auto" and parent.data.tags.get("weights_source") == "random":
        cfg.model.pretrained = False  # the plan found no weights and said so once; the folds need not say it again
    tags = {k: parent.data.tags.get(k, "") for k in ("model", "dataset", "protocol", "task", "subject_set", "seed")}
    work_dir = Path(job.work_dir)
    attempt = len(previous) + 1
    mlflow.set_tracking_uri(job.tracking_uri)
    run = mlflow.start_run(experiment_id=parent.info.experiment_id, run_name=f"fold {job.fold}",
                           tags={**tags, "mlflow.parentRunId": job.parent_run_id, "painvit.run_kind": "fold",
                                 "fold": str(job.fold), "painvit.attempt": str(attempt),
                                 "painvit.tracking_uri": job.tracking_uri, **job_owner_tags()})
    try:
        mlflow.log_params({"fold": job.fold})
        result = train_fold(cfg, job.fold, resolve_path(cfg.fold_file), work_dir,
                            keep_model=cfg.cv.log_models)
    except BaseException as error:
        mlflow.log_text(traceback.format_exc(), "traceback.txt")
        interrupted = isinstance(error, KeyboardInterrupt | SystemExit)
        mlflow.end_run("KILLED" if interrupted else "FAILED")
        raise
    mlflow.end_run("FINISHED")
    shutil.rmtree(work_dir, ignore_errors=True)  # the model and the tables now live in the tracking store
    result.run_id = run.info.run_id
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.fold <job.json>`: run one fold job (what the parallel launcher starts per fold)."""
    from pipeline.cli import setup_logging

    args = sys.argv[1:] if argv is None else argv
    setup_logging()
    run_fold_job(FoldJob.read(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
