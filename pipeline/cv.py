"""`make cv`: participant-grouped cross-validation of one backbone, tracked in MLflow.

One parent run per cross-validation (tags say what was compared on what), one child run per fold (per-epoch curves,
test metrics, plots, per-video predictions). A fresh model and optimizer per fold; early stopping and checkpoint
selection on the fold's inner-validation subjects; exactly one evaluation of the best checkpoint on the test subjects.
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline import PROJECT_ROOT, tracking
from pipeline.backbones import create_model
from pipeline.cli import resolve_path
from pipeline.datamodule import PainDataModule
from pipeline.folds import fold_file_sha256
from pipeline.metrics import (
    classification_metrics,
    evaluate_predictions,
    plot_confusion,
    plot_roc,
    plot_training_curves,
    summarize_folds,
)
from pipeline.module import FreezeBackbone, OptimConfig, PainClassifier
from pipeline.prepare import prepare_data, read_fold_file
from pipeline.tasks import get_task
from pipeline.weights import WeightsSource

log = logging.getLogger(__name__)
REPORTED = ("auroc", "accuracy", "balanced_accuracy", "f1")


@dataclass
class FoldResult:
    fold: int
    metrics: dict[str, float]  # test/<level>_<metric>
    predictions: pd.DataFrame  # per-frame test predictions
    videos: pd.DataFrame  # per-video test predictions
    epochs: int
    best_epoch: int
    seconds: float


class MlflowEpochLogger(pl.Callback):
    """Logs each epoch's train/val metrics to the active MLflow run (step = epoch) and keeps them for the plot.

    Hooked on the end of the training epoch: by then the epoch's validation has run and Lightning has reduced the
    epoch-level train metrics (callbacks' on_validation_epoch_end runs before the module has logged val metrics).
    """

    def __init__(self) -> None:
        self.history: list[dict] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if k.startswith(("train/", "val/")) and torch.numel(v) == 1}
        metrics["lr/head"] = trainer.optimizers[0].param_groups[-1]["lr"] if trainer.optimizers else float("nan")
        mlflow.log_metrics(metrics, step=trainer.current_epoch)
        self.history.append({"epoch": trainer.current_epoch, **metrics})


def git_commit() -> str:
    """HEAD's commit (suffixed -dirty with uncommitted changes), or 'unknown' outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def precision_for(setting: str) -> str:
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def use_channels_last(setting: bool | str, model_name: str) -> bool:
    """channels_last helps convolutions on GPUs; a plain ViT gains nothing from it."""
    if setting != "auto":
        return bool(setting)
    return torch.cuda.is_available() and not model_name.startswith("vit")


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


def warn_from_scratch(model_name: str, source: WeightsSource) -> None:
    if source.kind != "random":
        return
    message = (f"{model_name} is training FROM SCRATCH (no pretrained weights). Transformers need far more data than "
               f"87 (or a few synthetic) people to learn from random weights: the ViT paper's lesson is that a ViT "
               f"only beats convolutional nets after large-scale pretraining, and hybrids like CvT and MobileViT "
               f"cope better with little data. Scores are not comparable with fine-tuned runs; provide weights "
               f"with WEIGHTS=/path or pretrained=true to fine-tune.")
    log.warning(message)
    warnings.warn(message, stacklevel=2)


def train_fold(cfg: DictConfig, fold: int, fold_file: Path, work_dir: Path) -> FoldResult:
    """Train on the fold's training subjects, select on its validation subjects, test once on its test subjects."""
    started = time.time()
    if cfg.trainer.devices != 1:
        raise ValueError("trainer.devices must be 1: video-level metrics are computed from one process's predictions")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = get_task(cfg.task.name)
    net, _ = create_model(cfg.model.name, n_classes=task.n_classes, pretrained=cfg.model.pretrained,
                          weights=cfg.model.weights, img_size=cfg.model.img_size)
    channels_last = use_channels_last(cfg.trainer.channels_last, cfg.model.name)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    datamodule = PainDataModule(
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
        aggregation=cfg.trainer.aggregation, topk=cfg.trainer.topk, channels_last=channels_last)

    epoch_logger = MlflowEpochLogger()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="best", monitor=cfg.trainer.monitor,
                                              mode=cfg.trainer.monitor_mode, save_top_k=1, save_weights_only=True)
    early_stopping = pl.callbacks.EarlyStopping(monitor=cfg.trainer.monitor, mode=cfg.trainer.monitor_mode,
                                                patience=cfg.trainer.patience)
    callbacks = [epoch_logger, checkpoint, early_stopping]
    if cfg.model.optim.freeze_backbone_epochs > 0:
        callbacks.append(FreezeBackbone(cfg.model.optim.freeze_backbone_epochs))
    limits = {k: cfg.trainer[k] for k in ("limit_train_batches", "limit_val_batches") if cfg.trainer[k] is not None}
    trainer = pl.Trainer(
        max_epochs=cfg.trainer.max_epochs, accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices,
        precision=precision_for(cfg.trainer.precision), gradient_clip_val=cfg.trainer.gradient_clip_val,
        deterministic=cfg.trainer.deterministic, log_every_n_steps=cfg.trainer.log_every_n_steps,
        callbacks=callbacks, logger=False, default_root_dir=work_dir, enable_model_summary=False,
        num_sanity_val_steps=0, **limits)
    trainer.fit(module, datamodule=datamodule)
    if not checkpoint.best_model_path:
        raise RuntimeError(f"fold {fold}: no checkpoint was selected on {cfg.trainer.monitor} (was it logged?); "
                           f"refusing to test the last epoch's weights instead")
    trainer.test(module, datamodule=datamodule, ckpt_path=checkpoint.best_model_path, verbose=False)

    results = module.test_results
    metrics = {f"test/{level}_{name}": float(value) for level in ("frame", "video")
               for name, value in results[level].items()}
    best_epoch = next((h["epoch"] for h in epoch_logger.history
                       if checkpoint.best_model_score is not None
                       and np.isclose(h.get(cfg.trainer.monitor, np.nan), float(checkpoint.best_model_score))), -1)
    metrics.update({"best_epoch": best_epoch, "epochs_trained": len(epoch_logger.history),
                    "best_val_score": float(checkpoint.best_model_score or np.nan)})

    # Fold artifacts: plots and tables a person opens in the MLflow UI. Names and predictions only, never faces.
    out = work_dir / "artifacts"
    out.mkdir(parents=True)
    videos = results["videos"]
    plot_confusion(results["confusion_video"], task.classes, out / "confusion_video.png", f"fold {fold}: videos")
    plot_confusion(results["confusion_frame"], task.classes, out / "confusion_frame.png", f"fold {fold}: frames")
    if task.is_binary and videos["label"].nunique() == 2:
        plot_roc(videos["label"].to_numpy(), videos[f"prob_{task.classes[1]}"].to_numpy(), out / "roc_video.png",
                 f"fold {fold}: video ROC")
    if epoch_logger.history:
        plot_training_curves(pd.DataFrame(epoch_logger.history), out / "training_curves.png")
    videos.to_csv(out / "predictions_videos.csv", index=False)
    module.test_predictions.drop(columns=["crop_path"], errors="ignore").to_csv(out / "predictions_frames.csv",
                                                                               index=False)
    results["per_subject"].to_csv(out / "accuracy_per_subject.csv", index=False)
    (out / "splits.json").write_text(json.dumps(datamodule.split_summary(), indent=2, default=str))
    mlflow.log_metrics(metrics)
    mlflow.log_artifacts(str(out))
    return FoldResult(fold, metrics, module.test_predictions, videos, len(epoch_logger.history), best_epoch,
                      time.time() - started)


def _flat_params(cfg: DictConfig) -> dict[str, str]:
    flat = pd.json_normalize(OmegaConf.to_container(cfg), sep=".").iloc[0].to_dict()
    return {k: str(v)[:500] for k, v in flat.items()}


def fold_line(result: FoldResult, index: int, n_folds: int) -> str:
    m = result.metrics
    return (f"fold {result.fold} ({index}/{n_folds}): video AUROC {m['test/video_auroc']:.3f} "
            f"acc {m['test/video_accuracy']:.3f} bal-acc {m['test/video_balanced_accuracy']:.3f} | "
            f"frame AUROC {m['test/frame_auroc']:.3f} | {result.epochs} epochs (best {result.best_epoch}) | "
            f"{result.seconds:.0f} s")


def run_cv(cfg: DictConfig) -> dict:
    """Prepare data if needed, then cross-validate cfg.model on every fold; returns the aggregate metrics."""
    frames_result, fold_file = prepare_data(cfg)
    folds = read_fold_file(fold_file, sorted(set(frames_result.frames.subject_name)))
    fold_ids = sorted(folds.fold.unique()) if cfg.trainer.folds is None else list(cfg.trainer.folds)
    task = get_task(cfg.task.name)

    # Resolve the weights once before any training, so a missing checkpoint fails in seconds, not after fold 1.
    _, weights = create_model(cfg.model.name, n_classes=task.n_classes, pretrained=cfg.model.pretrained,
                              weights=cfg.model.weights, img_size=cfg.model.img_size)
    warn_from_scratch(cfg.model.name, weights)

    uri = cfg.mlflow.tracking_uri or tracking.tracking_uri(PROJECT_ROOT)
    mlflow.set_tracking_uri(uri)
    artifact_root = resolve_path(cfg.mlflow.artifact_root) if cfg.mlflow.artifact_root else tracking.artifact_root(
        PROJECT_ROOT)
    experiment_id = tracking.get_or_create_experiment(cfg.mlflow.experiment, artifact_root)
    tags = {"painvit.run_kind": "cv", "model": cfg.model.name, "dataset": cfg.data.name,
            "protocol": cfg.protocol.name, "task": task.name, "subject_set": cfg.data.subject_set,
            "seed": str(cfg.seed), "git_commit": git_commit(), "fold_file": str(fold_file),
            "fold_file_sha256": fold_file_sha256(fold_file), "n_folds": str(len(fold_ids)),
            # a smoke run (some folds, limited batches) is marked so that nobody mistakes it for a full CV
            "complete": str(len(fold_ids) == folds.fold.nunique() and cfg.trainer.limit_train_batches is None
                            and cfg.trainer.limit_val_batches is None).lower(),
            **weights.as_tags()}
    run_name = f"{cfg.model.name} {cfg.data.name} {cfg.protocol.name} {task.name}"
    print(f"cross-validation: {run_name}, {len(fold_ids)} folds, weights: {weights.kind} {weights.ref}")
    print(f"MLflow: {uri} (experiment {cfg.mlflow.experiment}); `make ui` to review")

    results: list[FoldResult] = []
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags) as parent:
        mlflow.log_params(_flat_params(cfg))
        mlflow.log_text(OmegaConf.to_yaml(cfg), "config.yaml")
        mlflow.log_artifact(str(fold_file), "folds")
        for fold in fold_ids:
            child_tags = {k: tags[k] for k in ("model", "dataset", "protocol", "task", "subject_set", "seed")}
            with mlflow.start_run(experiment_id=experiment_id, run_name=f"fold {fold}", nested=True,
                                  tags={**child_tags, "painvit.run_kind": "fold", "fold": str(fold)}):
                mlflow.log_params({"fold": fold, **{f"weights.{k}": v for k, v in weights.as_tags().items()}})
                with tempfile.TemporaryDirectory(prefix=f"fold{fold}-") as work_dir:
                    result = train_fold(cfg, int(fold), fold_file, Path(work_dir))
            results.append(result)
            print(fold_line(result, len(results), len(fold_ids)), flush=True)
        summary = log_aggregate(results, task.classes, cfg)
        print_table(results, summary)
        print(f"parent run {parent.info.run_id}")
    return summary


def log_aggregate(results: list[FoldResult], class_names, cfg: DictConfig) -> dict[str, float]:
    """Mean and std across folds, and pooled metrics over all test videos/frames, onto the parent run."""
    fold_metrics = [{k.removeprefix("test/"): v for k, v in r.metrics.items() if k.startswith("test/")}
                    for r in results]
    summary = {f"cv/{k}": v for k, v in summarize_folds(fold_metrics).items()}
    videos = pd.concat([r.videos for r in results], ignore_index=True)
    frames = pd.concat([r.predictions for r in results], ignore_index=True)
    prob_columns = [f"prob_{c}" for c in class_names]
    pooled_video = classification_metrics(videos["label"].to_numpy(), videos[prob_columns].to_numpy())
    pooled_frame = classification_metrics(frames["label"].to_numpy(), frames[prob_columns].to_numpy())
    summary.update({f"pooled/video_{k}": v for k, v in pooled_video.items()})
    summary.update({f"pooled/frame_{k}": v for k, v in pooled_frame.items()})
    mlflow.log_metrics({k: float(v) for k, v in summary.items() if np.isfinite(v)})

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table = pd.DataFrame([{"fold": r.fold, **r.metrics, "seconds": round(r.seconds, 1)} for r in results])
        table.to_csv(out / "folds_summary.csv", index=False)
        videos.to_csv(out / "predictions_videos_all_folds.csv", index=False)
        pooled = evaluate_predictions(frames, class_names, cfg.trainer.aggregation, cfg.trainer.topk)
        plot_confusion(pooled["confusion_video"], class_names, out / "confusion_video_pooled.png",
                       "all test videos")
        if len(class_names) == 2 and videos["label"].nunique() == 2:
            plot_roc(videos["label"].to_numpy(), videos[prob_columns[1]].to_numpy(), out / "roc_video_pooled.png",
                     "all test videos")
        pooled["per_subject"].to_csv(out / "accuracy_per_subject.csv", index=False)
        mlflow.log_artifacts(str(out))
    return summary


def print_table(results: list[FoldResult], summary: dict[str, float]) -> None:
    rows = {f"fold {r.fold}": {m: r.metrics[f"test/video_{m}"] for m in REPORTED} for r in results}
    rows["mean"] = {m: summary[f"cv/video_{m}_mean"] for m in REPORTED}
    rows["std"] = {m: summary[f"cv/video_{m}_std"] for m in REPORTED}
    rows["pooled"] = {m: summary[f"pooled/video_{m}"] for m in REPORTED}
    table = pd.DataFrame(rows).T
    table.columns = [f"video {m}" for m in REPORTED]
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))
