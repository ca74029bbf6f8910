"""One fold's training: the one path a fold of a cross-validation, the final model and a tuning trial share.

What the plan decides once for every fold travels in `FoldDecisions` (`pipeline.runs.jobs.fold_decisions`); what
depends on the device is resolved on the device the fold trains on (`settings_on_device`). A fold of a
cross-validation runs under a child run of its own (`pipeline.runs.jobs.fold_run`, its `FoldJob`); what it returns is
a `FoldResult` (`pipeline.models.fold_result`), filled in step by step.

The steps, each a function: `build_fold` (model, data, LightningModule), `train` (the fit where the head mode fits,
`pipeline.runs.jobs.fold_fit`: select on the inner validation subjects, epoch checkpoints; the best checkpoint scored
once on the test subjects; a second stage where the mode has one), then in `train_fold` the threshold on the
validation videos, `fold_test_metrics`, `log_fold_artifacts` (plots and tables: `write_fold_artifacts`) and
`log_kept_model` (the self-describing model file).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytorch_lightning as pl

from pipeline.data.datamodule import PainDataModule, SubjectRoles
from pipeline.data.embeddings import EmbeddingDataModule
from pipeline.evaluation.graded import decided_levels, fold_graded_metrics, write_level_confusion
from pipeline.evaluation.metrics import (
    Evaluation,
    calibration_metrics,
    decided_confusions,
    decided_per_subject,
    plot_confusion,
    plot_roc,
    plot_training_curves,
)
from pipeline.evaluation.thresholds import decide_fold, rule_name, threshold_spread
from pipeline.models.backbone_adapter import Backbone
from pipeline.models.backbones import PainNet
from pipeline.models.embedding_cache import CachedEmbeddings, ensure_embeddings
from pipeline.models.factory import create_model
from pipeline.models.finetune import FinetuneStrategy, parameter_counts, strategy_for
from pipeline.models.fold_result import FoldResult
from pipeline.models.lightning_module import PainLightningModule
from pipeline.models.model_file import MODEL_ARTIFACT
from pipeline.models.ordinal import OutputConfig, task_levels
from pipeline.models.temporal_heads import ClipNet, HeadConfig, head_parameters
from pipeline.runs.jobs.fold_decisions import DecisionNotHonoured, FoldDecisions, settings_here
from pipeline.runs.jobs.head_modes import BuiltFold, log_history
from pipeline.runs.jobs.sealing import FRAME_PREDICTIONS, VIDEO_PREDICTIONS
from pipeline.runs.jobs.step_times import StepTimes
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.two_stage import RECORD as TWO_STAGE_RECORD
from pipeline.runs.jobs.two_stage import write_record
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.serving.mlflow_model import log_fold_model
from pipeline.runs.store.registry import log_subjects, split_videos
from pipeline.runs.store.run_record import RunRecord
from pipeline.runs.store.tracking import THRESHOLD_FALLBACK_TAG, THRESHOLD_RULE_TAG, device_settings_tags, weights_tags
from pipeline.utils.atomic_io import fsync_tree
from pipeline.utils.devices import DeviceSettings

log = logging.getLogger(__name__)
VAL_VIDEO_PREDICTIONS = "predictions_videos_val.csv"  # the best checkpoint on the validation subjects


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


def build_network(model_name: str, img_size: int | None, output: OutputConfig, n_classes: int,
                  decisions: FoldDecisions, *, head: HeadConfig | None = None, strategy: FinetuneStrategy | None = None,
                  channels_last: bool = False) -> PainNet | ClipNet:
    """The network (`pipeline.models.factory.create_model`: a frame model, or a clip model under `head`, prepared for
    `strategy`) with the initial weights the plan chose, or an error saying why this machine differs."""
    planned = decisions.weights_source
    net, loaded = create_model(model_name, n_classes, pretrained=planned.kind != "random",
                               weights=planned.ref if planned.kind == "file" else None, img_size=img_size,
                               head=head, strategy=strategy, channels_last=channels_last, output=output)
    if (loaded.kind, loaded.sha256) != (planned.kind, planned.sha256):
        raise DecisionNotHonoured(f"{model_name}: the plan chose weights {planned.kind} {planned.ref} (sha256 "
                                  f"{planned.sha256}), this machine found {loaded.kind} {loaded.ref} (sha256 "
                                  f"{loaded.sha256}); give every node the same weights file (WEIGHTS=/shared/path)")
    if net.backbone.family != decisions.model_family:
        raise DecisionNotHonoured(f"{model_name}: the plan saw a {decisions.model_family} backbone, this machine "
                                  f"builds a {net.backbone.family} one (another timm or transformers version?)")
    return net


def fold_network(training: TrainingSettings, trains: WhatTrains, decisions: FoldDecisions,
                 settings: DeviceSettings | None = None) -> tuple[PainNet, FinetuneStrategy, bool, bool]:
    """The fold's network, seeded first (so that a random start is the same in every process that builds it), its
    fine-tuning strategy, whether it reads the embedding cache (a frozen backbone's features are the same in every
    fold: computed once, `shared_embeddings`) and whether it runs channels-last."""
    pl.seed_everything(training.seed, workers=True, verbose=False)
    trainer, finetune = training.trainer, trains.finetune
    cached = finetune.reads_cache
    strategy = strategy_for(finetune, embeddings=cached)
    channels_last = not cached and (settings or settings_here(decisions, trainer.channels_last,
                                                              trainer.accelerator)).channels_last
    # end to end: the backbone runs on every frame of a clip and trains through the temporal head
    n_levels = task_levels(trains.task, trains.output)  # a graded task's, if ordinal
    net = build_network(training.model_name, training.img_size, trains.output, n_levels, decisions,
                        head=trains.mode.network_head(), strategy=strategy, channels_last=channels_last)
    return net, strategy, cached, channels_last


def shared_embeddings(training: TrainingSettings, backbone: Backbone) -> CachedEmbeddings:
    """The embedding cache's shared entry of `backbone` over the crops the fold's loader reads (built if missing)."""
    loader = training.loader
    return ensure_embeddings(backbone, training.processed_dir, crop_fraction=loader.crop_fraction,
                             from_s=loader.from_s, frames_per_video=loader.frames_per_video, augment=training.augment,
                             settings=training.cache, progress=sys.stderr.isatty(), workers=loader.num_workers)


def prepare_shared_embeddings(training: TrainingSettings, decisions: FoldDecisions) -> CachedEmbeddings | None:
    """Before fold jobs that read the embedding cache start side by side, each on a core of its own: the entry they
    read, built once here (on this process's threads) where it is missing, instead of by each of them at once; read
    and checked where it is there. None where the folds of `training` read no cache."""
    trains = WhatTrains.of(training).check()
    if not trains.finetune.reads_cache:
        return None
    net = fold_network(training, trains, decisions)[0]
    return shared_embeddings(training, net.backbone)


def build_fold(training: TrainingSettings, trains: WhatTrains, roles: SubjectRoles, decisions: FoldDecisions,
               settings: DeviceSettings | None = None) -> BuiltFold:
    """A fresh model, the data of the subjects' `roles` (a fold's, the final model's split, a study's inner split)
    and the LightningModule; also the weights' provenance as tags and the head mode's policy (`trains.mode`).

    `settings`: the device-dependent settings (`settings_here` when None)."""
    trainer = training.trainer
    task, mode = trains.task, trains.mode
    net, strategy, cached, channels_last = fold_network(training, trains, decisions, settings)
    processed_dir, loader, augment = training.processed_dir, training.loader, training.augment
    if cached:
        entry = shared_embeddings(training, net.backbone)
        datamodule: PainDataModule = EmbeddingDataModule(
            processed_dir, roles, task, net.backbone.data_config, augment, loader, training.seed,
            embeddings=entry.table, source=entry.path, personalise=trains.personalise)
    else:
        datamodule = PainDataModule(processed_dir, roles, task, net.backbone.data_config, augment, loader,
                                    training.seed, clips=mode.clips)
    datamodule.setup()
    train_labels = datamodule.dataset("train").labels  # per crop, or per video for clips
    module = PainLightningModule(
        net, task.classes, training.optim, label_smoothing=trainer.label_smoothing,
        class_weights=class_weights_for(trainer.class_weights, train_labels, task.n_classes),
        aggregation=mode.aggregation(trainer.aggregation), topk=trainer.topk, decoding=trains.decoding,
        channels_last=channels_last, monitor=trainer.monitor, finetune=strategy)
    return BuiltFold(module, datamodule, weights_tags(decisions.weights_source), mode)


def write_fold_artifacts(out: Path, fold: int, class_names: tuple[str, ...], predictions: pd.DataFrame,
                         evaluation: Evaluation, history: list[dict], splits: dict, plots: bool = True) -> None:
    """Plots (`plots`: cv.fold_plots) and tables a person opens in the MLflow UI. Names and predictions only, never
    faces."""
    out.mkdir(parents=True, exist_ok=True)
    videos = evaluation.video_predictions  # with the fold's decisions: the confusion counts the calls as made
    if plots:
        plot_fold(out, fold, class_names, evaluation, history)
    videos.to_csv(out / VIDEO_PREDICTIONS, index=False)
    predictions.drop(columns=["crop_path"], errors="ignore").to_csv(out / FRAME_PREDICTIONS, index=False)
    decided_per_subject(videos).to_csv(out / "accuracy_per_subject.csv", index=False)
    (out / "splits.json").write_text(json.dumps(splits, indent=2, default=str))


def plot_fold(out: Path, fold: int, class_names: tuple[str, ...], evaluation: Evaluation,
              history: list[dict]) -> None:
    """The fold's confusion matrices (videos at the fold's decision, frames), video ROC and training curves."""
    videos = evaluation.video_predictions
    plot_confusion(decided_confusions(videos, len(class_names))[None], class_names, out / "confusion_video.png",
                   f"fold {fold}: videos, at the fold's decision")
    plot_confusion(evaluation.confusion_frame, class_names, out / "confusion_frame.png", f"fold {fold}: frames")
    if len(class_names) == 2 and videos["label"].nunique() == 2:
        plot_roc(videos["label"].to_numpy(), videos[f"prob_{class_names[1]}"].to_numpy(), out / "roc_video.png",
                 f"fold {fold}: video ROC")
    if history:
        plot_training_curves(pd.DataFrame(history), out / "training_curves.png")


def log_threshold_fallback(fold: int, fallback: str, record: RunRecord) -> None:
    """A fold whose validation videos could not choose a threshold says so: a warning and the tag
    `threshold_fallback` with the reason (the metric `test/threshold_fallback` is 1 for it, 0 otherwise)."""
    if fallback:
        log.warning("fold %d: the threshold rule could not choose (%s); its test videos are called at 0.5",
                    fold, fallback)
        record.set_tags({THRESHOLD_FALLBACK_TAG: fallback})


def train(training: TrainingSettings, built: BuiltFold, work_dir: Path, settings: DeviceSettings, *,
          callbacks: Sequence[pl.Callback] = (), scored: Sequence[str] = ("val", "test"),
          times: StepTimes | None = None, record: RunRecord | None = None) -> FoldResult:
    """The one training path of a fold, the final model and a tuning trial, on what `build_fold` built (through the
    model factory, over the subjects' roles): train as the head mode trains (its `train`: the fit, Lightning's
    `fit_fold` or in memory, selected on the validation subjects, the best scored on the splits in `scored`, `val`:
    re-validated for the threshold, `test`: tested once; and a second stage where the mode has one). `callbacks` join
    the fit (a lease check, a trial's pruning). A mode whose fit does not log its epochs as they end (in memory):
    they are logged here, gathered in `record` (None: on the active MLflow run)."""
    result = built.mode.train(training, built, work_dir, settings.precision, callbacks, scored, times or StepTimes())
    if not built.mode.fit_logs_epochs:
        log_history(result.history, record)
    return result


def train_fold(training: TrainingSettings, fold: int, decisions: FoldDecisions, work_dir: Path,
               keep_model: bool = False, settings: DeviceSettings | None = None,
               callbacks: Sequence[pl.Callback] = (), record: RunRecord | None = None) -> FoldResult:
    """Train on the fold's training subjects, select on its validation subjects, test once on its test subjects
    (`train`); choose the threshold, log and keep what the CV reads.

    `settings`: precision and channels_last as resolved on this device (`settings_here` when None), tagged on the
    run. `callbacks` join the fit (the fold job's lease check). `record`: where the fold run's parameters, tags and
    metrics are gathered, for the caller to write (`RunRecord.flush`); None: the active MLflow run's, written here.
    Its artifacts are stored as they are written.
    """
    started = time.time()
    times = StepTimes()
    work_dir.mkdir(parents=True, exist_ok=True)
    own_record = record is None
    record = record or RunRecord.of_active_run()
    trains = WhatTrains.of(training).check()
    with times("setup"):
        settings = settings or settings_here(decisions, training.trainer.channels_last, training.trainer.accelerator)
        built = set_up_fold(training, trains, fold, decisions, settings, record)
    result = train(training, built, work_dir, settings, callbacks=callbacks, times=times, record=record)
    validation, evaluation = result.validation, result.evaluation
    assert validation is not None and evaluation is not None and result.frame_predictions is not None
    class_names = built.module.class_names
    record.log_params({"head": built.mode.head.label, "head_parameters": kept_head_parameters(built, result)})
    with times("threshold"):  # the threshold sees the validation subjects only; the test videos get it as it is
        threshold, evaluation.video_predictions, decided, fallback = decide_fold(
            validation.video_predictions, evaluation.video_predictions, class_names, training.threshold_rule)
    result.video_predictions = evaluation.video_predictions
    result.metrics = fold_test_metrics(built, result, threshold, decided, trains.graded)
    rule = rule_name(training.threshold_rule, len(class_names))
    with times("artifacts"):
        log_fold_artifacts(built, result, work_dir / "artifacts", rule, fallback, trains.graded, training.fold_plots,
                           record)
    if keep_model:
        with times("model_logging"):
            log_kept_model(training, built, result, work_dir, threshold, rule)
    record.log_metrics(times.metrics())
    if own_record:
        record.flush()
    log.info("fold %d steps: %s", fold, times.line())
    result.seconds = time.time() - started
    return result


def set_up_fold(training: TrainingSettings, trains: WhatTrains, fold: int, decisions: FoldDecisions,
                settings: DeviceSettings, record: RunRecord) -> BuiltFold:
    """`build_fold`, with what it built logged on the fold run (`record`): the device settings, the parameters
    trainable, what trains (`trains`: the fine-tuning strategy, the augmentation) and the subjects' videos (an MLflow
    dataset, stored now)."""
    record.set_tags(device_settings_tags(settings))
    built = build_fold(training, trains, SubjectRoles.of_fold(Path(decisions.fold_file), fold), decisions, settings)
    module, datamodule = built.module, built.datamodule
    counts = parameter_counts(module.model)
    log.info("fold %d: %s, %d of %d parameters trainable (backbone %d of %d); augmentation: %s", fold,
             module.finetune.name, counts["parameters_trainable"], counts["parameters_total"],
             counts["backbone_parameters_trainable"], counts["backbone_parameters"], trains.augmentation_label)
    record.log_params(counts)
    record.set_tags(trains.tags())
    log_subjects(record.client, record.run_id, split_videos(datamodule),
                 f"{training.dataset}-{trains.task.name}-fold{fold}")
    return built


def kept_head_parameters(built: BuiltFold, result: FoldResult) -> int:
    """The size of the head that is kept: a second stage's (its record), else the network's own head."""
    if result.record:
        return result.record["head_parameters"]
    return head_parameters(built.module.model.head)


def fold_test_metrics(built: BuiltFold, result: FoldResult, threshold: float, decided: dict[str, float],
                      graded: bool) -> dict:
    """The fold run's metrics: the test split's scores (at the fold's threshold too), what was selected, the frame
    model's of a two-stage head, the protocol's; the threshold's spread, calibration, and where `graded` (a graded
    task, `ordinal.graded_scoring`) its levels."""
    validation, evaluation, class_names = result.validation, result.evaluation, built.module.class_names
    assert validation is not None and evaluation is not None
    metrics = {**evaluation.metrics(prefix="test/"), **{f"test/{k}": v for k, v in decided.items()},
               **result.selected, **result.frame_model_metrics, **built.datamodule.protocol_metrics()}
    if np.isfinite(threshold):
        metrics["test/threshold"] = threshold
        # how much each rule's threshold moves over a bootstrap of the validation subjects (test/threshold_ci95_*)
        metrics.update({f"test/{k}": v for k, v in threshold_spread(
            validation.video_predictions, f"prob_{class_names[1]}").items()})
    videos = evaluation.video_predictions  # calibration of the video probabilities: test/video_brier, _ece
    metrics.update({f"test/video_{k}": v for k, v in calibration_metrics(
        videos["label"].to_numpy(), videos[[f"prob_{c}" for c in class_names]].to_numpy()).items()})
    if videos["subject_name"].nunique() == 1:  # leave one subject out: AUROC within a person
        metrics["test/within_subject_video_auroc"] = metrics["test/video_auroc"]
    if graded:  # MAE, kappa, Spearman within subject of the calls as made (test/video_mae, ...)
        metrics.update({f"test/{k}": v for k, v in fold_graded_metrics(videos, class_names).items()})
    return metrics


def log_fold_artifacts(built: BuiltFold, result: FoldResult, out: Path, rule: str, fallback: str, graded: bool,
                       plots: bool, record: RunRecord) -> None:
    """The fold's plots (`plots`: cv.fold_plots) and tables (`write_fold_artifacts`, a second stage's record and
    epochs, the validation videos, a graded task's level confusion) written to `out`, flushed and stored; the
    metrics and the rule gathered in `record`."""
    fold, validation, evaluation, class_names = result.fold, result.validation, result.evaluation, \
        built.module.class_names
    assert validation is not None and evaluation is not None and result.frame_predictions is not None
    write_fold_artifacts(out, fold, class_names, result.frame_predictions, evaluation, result.history,
                         built.datamodule.split_summary(), plots)
    if result.record:  # a second stage's record and epochs
        write_record(result.record, out / TWO_STAGE_RECORD)
        pd.DataFrame(result.head_history).to_csv(out / "head_training.csv", index=False)
    validation.video_predictions.to_csv(out / VAL_VIDEO_PREDICTIONS, index=False)
    if graded:
        write_level_confusion(decided_levels(evaluation.video_predictions, class_names), class_names, out,
                              "confusion_levels", f"fold {fold}: videos by level, as called", plot=plots)
    record.log_params({"threshold_rule": rule})
    record.set_tags({THRESHOLD_RULE_TAG: rule})
    log_threshold_fallback(fold, fallback, record)
    record.log_metrics(result.metrics)
    fsync_tree(out)  # the local copies on disk before upload: the work folder is kept until the CV finishes
    record.log_artifacts(out)


def log_kept_model(training: TrainingSettings, built: BuiltFold, result: FoldResult, work_dir: Path,
                   threshold: float, rule: str) -> None:
    """The fold's network as its head mode keeps it (the clip model of a two-stage head: the fold's frame backbone
    and its temporal head), a self-describing file logged beside the fold's MLflow model."""
    path = built.mode.keep(training, built, result, work_dir / Path(MODEL_ARTIFACT).name, fold=result.fold,
                           best_epoch=result.best_epoch)
    mlflow.log_artifact(str(path), str(Path(MODEL_ARTIFACT).parent))
    log_fold_model(training.config, path, result.fold, list(built.module.class_names), built.weights, threshold, rule)
