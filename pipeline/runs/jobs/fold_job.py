"""One fold of a cross-validation as a job that can run anywhere: this process, another process, a SLURM node.

A `FoldJob` holds plain values only (the resolved config, the fold id, the parent run id, the tracking URI and a
work folder), so it pickles for submitit and writes as JSON for a subprocess. `run_fold_job` is idempotent: a fold
that already has a FINISHED child run is not trained again, a child run left RUNNING by a killed attempt is marked
KILLED, and training continues from the fold's last epoch checkpoint when one exists.

A fold run is marked FINISHED only once what the CV reads of it is safe (`seal_fold`): its files flushed to disk (the
work folder's before upload, a file artifact store's copies after), the prediction tables and the kept model read
back from the store and compared with the local files by size and SHA-256, that record kept on the run
(`STORED_ARTIFACTS_TAG`), and the run still its own (`fold_lease`: a job whose fold was taken over stops and leaves
it). The work folder stays until the CV is aggregated. A FINISHED run whose files have since gone from the store is
not done (`retire_unreadable`): it is marked FAILED with the reason and the fold trained again.

The steps, each a function: `build_fold` (model, data, LightningModule), `fit_fold` (train, select on the inner
validation subjects, epoch checkpoints), `test_fold` (the best checkpoint, scored once on the test subjects),
`write_fold_artifacts` (plots and tables), `keep_fold_model` (the self-describing model file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import mlflow
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from mlflow import MlflowClient
from mlflow.entities import Run
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.plugins.io import TorchCheckpointIO

from pipeline.data.datamodule import LoaderConfig, PainDataModule
from pipeline.data.embeddings import embedding_variant
from pipeline.data.personalise import PersonaliseConfig, refuse_unapplied
from pipeline.data.tasks import get_task
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
from pipeline.models.backbones import PainNet, model_family, weights_source
from pipeline.models.callbacks import FreezeBackbone, KeepBestValidation, ResumableEarlyStopping, SeedEachBatch
from pipeline.models.embedding_cache import CacheSettings, ensure_embeddings
from pipeline.models.factory import create_model
from pipeline.models.finetune import FinetuneConfig, FinetuneStrategy, parameter_counts, strategy_for
from pipeline.models.lightning_module import OptimConfig, PainLightningModule
from pipeline.models.model_file import MODEL_ARTIFACT
from pipeline.models.ordinal import OutputConfig, check_frame_output, graded_scoring, task_levels
from pipeline.models.temporal_heads import ClipNet, HeadConfig
from pipeline.models.weights import WeightsSource
from pipeline.runs.jobs.head_modes import HeadMode, head_mode
from pipeline.runs.jobs.two_stage import RECORD as TWO_STAGE_RECORD
from pipeline.runs.jobs.two_stage import SecondStage, second_stage, write_record
from pipeline.runs.serving.mlflow_model import log_fold_model
from pipeline.runs.store import fold_lease
from pipeline.runs.store.cv_runs import augmentation_label, finetune_tags
from pipeline.runs.store.registry import split_videos, subjects_dataset
from pipeline.runs.store.tracking import (
    ATTEMPT_TAG,
    FAILED_REASON_TAG,
    FINISHED,
    FOLD_RUN,
    FOLD_TAG,
    HOST_TAG,
    JOB_TRACKING_URI_TAG,
    LEASE_LOST_TAG,
    PARENT_TAG,
    PID_TAG,
    RESUMED_AFTER_EPOCH_TAG,
    RUN_KIND_TAG,
    SLURM_JOB_TAG,
    STORED_ARTIFACTS_TAG,
    fold_runs,
    redact_uri,
    uri_has_credentials,
)
from pipeline.utils.accelerator import TrainingDevice, training_device
from pipeline.utils.atomic_io import atomic_path, fsync_tree
from pipeline.utils.cpus import one_torch_thread
from pipeline.utils.devices import DeviceSettings, device_settings
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)
FRAME_PREDICTIONS = "predictions_frames.csv"
VIDEO_PREDICTIONS = "predictions_videos.csv"
VAL_VIDEO_PREDICTIONS = "predictions_videos_val.csv"  # the best checkpoint on the validation subjects
SEALED = (FRAME_PREDICTIONS, VIDEO_PREDICTIONS)  # what a CV reads of a fold run (result_from_run); the kept model too


@dataclass(frozen=True)
class FoldDecisions:
    """What the plan decides once for every fold of a cross-validation. A fold job uses it as given: on a SLURM node
    it only checks that it can honour it (the same weights file, the same backbone family) and fails loudly if not.
    What depends on the device (precision, channels_last) is not decided here but by the fold job on the device it
    trains on (`resolve_on_device`), within what the plan allows."""

    fold_file: str  # the checked fold file, absolute
    precision: str  # trainer.precision as asked: `auto` (each fold resolves it on its device) or an explicit value
    model_family: str  # the backbone adapter's family (pipeline.models.backbones.FAMILIES)
    weights: dict[str, str | None]  # where the initial weights come from: WeightsSource's kind, ref, sha256

    @property
    def weights_source(self) -> WeightsSource:
        return WeightsSource(**self.weights)


def decide(cfg: DictConfig, fold_file: Path) -> FoldDecisions:
    """Resolve the fold file, the backbone family and the weights source of `cfg`, once; carry the precision as
    asked (the fold job resolves `auto` on its device).

    A missing weights file or hub cache entry fails here, in seconds, not in the first fold.
    """
    family = model_family(cfg.model.name, cfg.model.img_size)
    weights = weights_source(cfg.model.name, cfg.model.pretrained, cfg.model.weights)
    return FoldDecisions(str(resolve_path(fold_file)), str(cfg.trainer.precision), family, asdict(weights))


def resolve_on_device(cfg: DictConfig, decisions: FoldDecisions, device_kind: str) -> DeviceSettings:
    """Precision and channels_last for a fold training on a `device_kind` device: `auto` resolved from that
    device's facts, an explicit value honoured; an error if the result is not one the plan allows."""
    try:
        return device_settings(decisions.precision, cfg.trainer.channels_last, decisions.model_family, device_kind)
    except ValueError as error:
        raise DecisionNotHonoured(str(error)) from error


def resolve_here(cfg: DictConfig, decisions: FoldDecisions, device: TrainingDevice | None = None) -> DeviceSettings:
    """`resolve_on_device` for the device this process trains on (trainer.accelerator)."""
    device = device or training_device(cfg.trainer.accelerator)
    return resolve_on_device(cfg, decisions, device.kind)


class DecisionNotHonoured(RuntimeError):
    """A fold job cannot do what its plan decided (other weights on this node, another backbone family)."""


@dataclass(frozen=True)
class FoldJob:
    """Everything a fold needs, as plain values."""

    config: dict  # the resolved config (OmegaConf.to_container)
    fold: int
    parent_run_id: str
    tracking_uri: str
    work_dir: str  # the fold's own folder: epoch checkpoints (for resuming) and the kept model before upload
    decisions: FoldDecisions
    seed: int | None = None  # cv.seeds: this training seed instead of the config's `seed` (tagged on the child run)
    store_uri: str = ""  # the store the records live in (behind a launcher's server), tagged; "": tracking_uri

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


@dataclass
class FoldResult:
    """A trained and tested fold: its test metrics and predictions (per crop and per video)."""

    fold: int
    metrics: dict[str, float]  # test/<level>_<metric>, best_epoch, epochs_trained, best_val_score
    frame_predictions: pd.DataFrame
    video_predictions: pd.DataFrame
    seconds: float
    run_id: str = ""
    seed: int | None = None  # the training seed of a CV over several seeds (cv.seeds)

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
            mlflow.set_tag(RESUMED_AFTER_EPOCH_TAG, str(int(self.history[-1]["epoch"])))
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


def build_network(cfg: DictConfig, n_classes: int, decisions: FoldDecisions, *, head: HeadConfig | None = None,
                  strategy: FinetuneStrategy | None = None, channels_last: bool = False) -> PainNet | ClipNet:
    """The network (`pipeline.models.factory.create_model`: a frame model, or a clip model under `head`, prepared for
    `strategy`) with the initial weights the plan chose, or an error saying why this machine differs."""
    planned = decisions.weights_source
    net, loaded = create_model(cfg.model.name, n_classes, pretrained=planned.kind != "random",
                               weights=planned.ref if planned.kind == "file" else None, img_size=cfg.model.img_size,
                               head=head, strategy=strategy, channels_last=channels_last,
                               output=OutputConfig.from_config(cfg.model.get("output")))
    if (loaded.kind, loaded.sha256) != (planned.kind, planned.sha256):
        raise DecisionNotHonoured(f"{cfg.model.name}: the plan chose weights {planned.kind} {planned.ref} (sha256 "
                                  f"{planned.sha256}), this machine found {loaded.kind} {loaded.ref} (sha256 "
                                  f"{loaded.sha256}); give every node the same weights file (WEIGHTS=/shared/path)")
    if net.backbone.family != decisions.model_family:
        raise DecisionNotHonoured(f"{cfg.model.name}: the plan saw a {decisions.model_family} backbone, this machine "
                                  f"builds a {net.backbone.family} one (another timm or transformers version?)")
    return net


def build_fold(cfg: DictConfig, fold: int, decisions: FoldDecisions, settings: DeviceSettings | None = None,
               datamodule_class: type[PainDataModule] = PainDataModule,
               ) -> tuple[PainLightningModule, PainDataModule, dict]:
    """A fresh model, the fold's data and the LightningModule; also the weights' provenance as tags.

    `settings`: the device-dependent settings (`resolve_here` when None). `datamodule_class` lets the final model
    (`pipeline.deployment.final_model`) read its train / validation split the same way."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = get_task(cfg.task.name)
    finetune = FinetuneConfig.from_config(cfg)
    mode = head_mode(check_head(cfg))
    # a frozen backbone's features are the same in every fold: read them from the embedding cache (built if missing)
    cached = finetune.reads_cache
    strategy = strategy_for(finetune, embeddings=cached)
    channels_last = not cached and (settings or resolve_here(cfg, decisions)).channels_last
    # end to end: the backbone runs on every frame of a clip and trains through the temporal head
    n_levels = task_levels(task, OutputConfig.from_config(cfg.model.get("output")))  # a graded task's, if ordinal
    net = build_network(cfg, n_levels, decisions, head=mode.network_head(), strategy=strategy,
                        channels_last=channels_last)
    fold_file = Path(decisions.fold_file)
    processed_dir = resolve_path(cfg.data.processed_dir)
    loader = LoaderConfig.from_config(cfg.loader)
    augment = OmegaConf.to_container(cfg.augment)
    if cached:
        entry = ensure_embeddings(net.backbone, processed_dir, crop_fraction=loader.crop_fraction, from_s=loader.from_s,
                                  frames_per_video=loader.frames_per_video, augment=augment,
                                  settings=CacheSettings.from_config(cfg.cache), progress=sys.stderr.isatty(),
                                  workers=loader.num_workers)
        datamodule: PainDataModule = embedding_variant(datamodule_class)(
            processed_dir, fold_file, fold, task, net.backbone.data_config, augment, loader, seed=cfg.seed,
            embeddings=entry.table, source=entry.path,
            personalise=PersonaliseConfig.from_config(cfg.get("personalise")))
    else:
        datamodule = datamodule_class(processed_dir, fold_file, fold, task, net.backbone.data_config, augment, loader,
                                      seed=cfg.seed, clips=mode.clips)
    datamodule.setup()
    train_labels = datamodule.dataset("train").labels  # per crop, or per video for clips
    module = PainLightningModule(
        net, task.classes, OptimConfig(**OmegaConf.to_container(cfg.model.optim)),
        label_smoothing=cfg.trainer.label_smoothing,
        class_weights=class_weights_for(cfg.trainer.class_weights, train_labels, task.n_classes),
        aggregation=mode.aggregation(cfg), topk=cfg.trainer.topk,
        channels_last=channels_last,
        monitor=cfg.trainer.monitor, finetune=strategy)
    return module, datamodule, decisions.weights_source.as_tags()


def check_head(cfg: DictConfig) -> HeadConfig:
    """The config's head, checked against its fine-tuning strategy (also before a CV plans anything)."""
    head = HeadConfig.from_config(cfg.model.head)
    check_frame_output(OutputConfig.from_config(cfg.model.get("output")), head.temporal)
    finetune = FinetuneConfig.from_config(cfg)
    refuse_unapplied(PersonaliseConfig.from_config(cfg.get("personalise")), reads_cache=finetune.reads_cache,
                     temporal=head.temporal)  # applied to cached embeddings under a frame head only
    if head.end_to_end and finetune.backbone_fixed:
        raise ValueError("model.head.mode=end_to_end trains the backbone through the head, but model.finetune=frozen "
                         "fixes it: a frozen backbone's head over time is model.head.mode=two_stage (it reads cached "
                         "embeddings and skips the first stage)")
    return head


@dataclass
class Fitted:
    trainer: pl.Trainer
    best_path: str
    best_epoch: int
    best_score: float
    history: list[dict]
    best_validation: Evaluation | None = None  # the best epoch's validation, kept as it ran (None: not seen here)


class StepTimes:
    """Wall time of each step of a fold (`with times("fit"): ...`), logged as `time/<step>_s` and printed once:
    what a fold costs besides training."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        return {f"time/{step}_s": round(seconds, 3) for step, seconds in self.seconds.items()}

    def line(self) -> str:
        return ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.seconds.items())


def fit_fold(cfg: DictConfig, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
             precision: str, extra_callbacks: Sequence[pl.Callback] = ()) -> Fitted:
    """Train with early stopping; select the best epoch on the inner validation subjects.

    Every epoch writes `last.ckpt` into work_dir; a fold that finds one there continues from it, exactly: the
    checkpoint holds the weights, optimizer, LR schedule, early-stopping counter, best-checkpoint record and epoch
    history, and every random draw of the remaining epochs is keyed by (seed, fold, epoch[, batch])
    (`EpochSampler`, `SeedEachBatch`), so it does not depend on the epochs before having run in this process.
    `extra_callbacks` join the fit (a tuning trial's pruning callback, `pipeline.runs.orchestration.tuning`).
    """
    if cfg.trainer.devices != 1:
        raise ValueError("trainer.devices must be 1: video-level metrics are computed from one process's predictions")
    epoch_logger = MlflowEpochLogger()
    best = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="best", monitor=cfg.trainer.monitor,
                                        mode=cfg.trainer.monitor_mode, save_top_k=1, save_weights_only=True)
    # every epoch's full state, overwritten in place (Lightning's save_last only writes when another save happened)
    last = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="last", monitor=None, save_top_k=1,
                                        enable_version_counter=False)
    early_stopping = ResumableEarlyStopping(monitor=cfg.trainer.monitor, mode=cfg.trainer.monitor_mode,
                                           patience=cfg.trainer.patience)
    keeper = KeepBestValidation(cfg.trainer.monitor, cfg.trainer.monitor_mode)
    callbacks = [epoch_logger, best, last, early_stopping, SeedEachBatch(cfg.seed, datamodule.fold), keeper,
                 *extra_callbacks]
    if cfg.model.optim.freeze_backbone_epochs > 0:
        callbacks.append(FreezeBackbone(cfg.model.optim.freeze_backbone_epochs))
    plugins = [AtomicCheckpointIO()]
    if "SLURM_JOB_ID" in os.environ:  # submitit owns requeueing on SLURM; Lightning's own would requeue twice
        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(LeaveSigtermToSubmitit())
    limits = {k: cfg.trainer[k] for k in ("limit_train_batches", "limit_val_batches") if cfg.trainer[k] is not None}
    trainer = pl.Trainer(
        max_epochs=cfg.trainer.max_epochs, accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices,
        precision=precision,
        gradient_clip_val=cfg.trainer.gradient_clip_val, deterministic=cfg.trainer.deterministic,
        log_every_n_steps=cfg.trainer.log_every_n_steps, callbacks=callbacks, logger=False, plugins=plugins,
        default_root_dir=work_dir, enable_model_summary=False, num_sanity_val_steps=0,
        enable_progress_bar=sys.stderr.isatty(), **limits)  # a bar in a terminal, none in a job's log file
    resume_from = work_dir / "last.ckpt"
    if resume_from.is_file():
        log.warning("fold: continuing from the epoch checkpoint %s", resume_from)
    with one_torch_thread(module.finetune.on_embeddings):
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from.is_file() else None)
    if not best.best_model_path:
        raise RuntimeError(f"no checkpoint was selected on {cfg.trainer.monitor} (was it logged?); "
                           f"refusing to test the last epoch's weights instead")
    best_score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    best_epoch = next((h["epoch"] for h in epoch_logger.history
                       if np.isclose(h.get(cfg.trainer.monitor, np.nan), best_score)), -1)
    kept = keeper.evaluation if keeper.epoch == best_epoch >= 0 else None
    return Fitted(trainer, best.best_model_path, best_epoch, best_score, epoch_logger.history, kept)


def test_fold(fitted: Fitted, module: PainLightningModule,
              datamodule: PainDataModule) -> tuple[pd.DataFrame, Evaluation]:
    """Score the best checkpoint once on the test subjects: per-crop predictions and their evaluation."""
    with one_torch_thread(module.finetune.on_embeddings):
        fitted.trainer.test(module, datamodule=datamodule, ckpt_path=fitted.best_path, verbose=False)
    return module.test_predictions, module.test_evaluation


def validate_fold(fitted: Fitted, module: PainLightningModule, datamodule: PainDataModule) -> Evaluation:
    """The best checkpoint's scores on the fold's validation subjects (the last epoch's may be another epoch's): the
    predictions the decision threshold is chosen on. Kept from training when the best epoch ran in this process;
    otherwise (a fold resumed after its best epoch) the best checkpoint is validated again."""
    if fitted.best_validation is not None:
        return fitted.best_validation
    with one_torch_thread(module.finetune.on_embeddings):
        fitted.trainer.validate(module, datamodule=datamodule, ckpt_path=fitted.best_path, verbose=False)
    return module.val_evaluation


def write_fold_artifacts(out: Path, fold: int, class_names: tuple[str, ...], predictions: pd.DataFrame,
                         evaluation: Evaluation, history: list[dict], splits: dict) -> None:
    """Plots and tables a person opens in the MLflow UI. Names and predictions only, never faces."""
    out.mkdir(parents=True, exist_ok=True)
    videos = evaluation.video_predictions  # with the fold's decisions: the confusion counts the calls as made
    plot_confusion(decided_confusions(videos, len(class_names))[None], class_names, out / "confusion_video.png",
                   f"fold {fold}: videos, at the fold's decision")
    plot_confusion(evaluation.confusion_frame, class_names, out / "confusion_frame.png", f"fold {fold}: frames")
    if len(class_names) == 2 and videos["label"].nunique() == 2:
        plot_roc(videos["label"].to_numpy(), videos[f"prob_{class_names[1]}"].to_numpy(), out / "roc_video.png",
                 f"fold {fold}: video ROC")
    if history:
        plot_training_curves(pd.DataFrame(history), out / "training_curves.png")
    videos.to_csv(out / VIDEO_PREDICTIONS, index=False)
    predictions.drop(columns=["crop_path"], errors="ignore").to_csv(out / FRAME_PREDICTIONS, index=False)
    decided_per_subject(videos).to_csv(out / "accuracy_per_subject.csv", index=False)
    (out / "splits.json").write_text(json.dumps(splits, indent=2, default=str))


def log_threshold_fallback(fold: int, fallback: str) -> None:
    """A fold whose validation videos could not choose a threshold says so: a warning and the tag
    `threshold_fallback` with the reason (the metric `test/threshold_fallback` is 1 for it, 0 otherwise)."""
    if fallback:
        log.warning("fold %d: the threshold rule could not choose (%s); its test videos are called at 0.5",
                    fold, fallback)
        mlflow.set_tag("threshold_fallback", fallback)


@dataclass
class Trained:
    """What one training kept (`train`): the module and data it trained with, the epochs of its fit, the selected
    checkpoint's scores, and the second stage's head where its mode has one."""

    module: PainLightningModule
    datamodule: PainDataModule
    weights: dict[str, str]  # the initial weights' provenance, as tags
    mode: HeadMode
    history: list[dict]  # the fitted network's epochs ([] where a fixed backbone's head skips the fit)
    best_path: str | None  # the fit's best checkpoint (None: no fit)
    selected: dict[str, float]  # best_epoch, epochs_trained, best_val_score of what is kept (the head's, two-stage)
    validation: Evaluation | None  # the kept network on the validation subjects: what the threshold is chosen on
    predictions: pd.DataFrame | None  # the kept network's test predictions (per crop, or per video for clips)
    evaluation: Evaluation | None  # their evaluation
    frame_model_metrics: dict[str, float]  # a two-stage head's frame model on the test subjects (frame_model/test/)
    stage: SecondStage | None  # the second stage's head, its history and record (two_stage.json)

    @property
    def held_out(self) -> Evaluation:
        """The evaluation a threshold is chosen on: the validation's, or where only the test split was scored (a
        final model, whose test split is its validation subjects) the test's."""
        chosen = self.validation if self.validation is not None else self.evaluation
        assert chosen is not None, "the training scored neither split"
        return chosen

    def keep(self, cfg: DictConfig, path: Path, **extra) -> Path:
        """The network to keep as a self-describing file, as its head mode keeps it."""
        return self.mode.keep(cfg, self, path, **extra)


def train(cfg: DictConfig, fold: int, decisions: FoldDecisions, work_dir: Path, settings: DeviceSettings, *,
          datamodule_class: type[PainDataModule] = PainDataModule, callbacks: Sequence[pl.Callback] = (),
          scored: Sequence[str] = ("val", "test"), times: StepTimes | None = None,
          built: tuple[PainLightningModule, PainDataModule, dict] | None = None) -> Trained:
    """The one training path of a fold, the final model and a tuning trial: build (`build_fold`, through the model
    factory), fit and select the checkpoint where the head mode fits (`fit_fold`), score the best checkpoint on the
    splits in `scored` (`val`: re-validated for the threshold, `test`: tested once), then the second stage where the
    mode has one (its head's validation and test scores replace the frame model's).

    `datamodule_class`: the subjects' roles (a fold's, `final_model.FinalDataModule`'s, a study's); `callbacks` join
    the fit (a lease check, a trial's pruning); `built`: what `build_fold` returned, where the caller logged it."""
    times = times or StepTimes()
    module, datamodule, weights = built or build_fold(cfg, fold, decisions, settings, datamodule_class)
    mode = head_mode(HeadConfig.from_config(cfg.model.head))
    history: list[dict] = []
    best_path, selected, validation, predictions, evaluation = None, {}, None, None, None
    if mode.trains_first_stage(FinetuneConfig.from_config(cfg)):  # a frame model, or an end-to-end clip model
        with times("fit"):
            fitted = fit_fold(cfg, module, datamodule, work_dir, settings.precision, callbacks)
        if "val" in scored:
            with times("validation_repass"):
                validation = validate_fold(fitted, module, datamodule)
        if "test" in scored:
            with times("test"):
                predictions, evaluation = test_fold(fitted, module, datamodule)
        best_path, history = fitted.best_path, fitted.history
        selected = {"best_epoch": fitted.best_epoch, "epochs_trained": len(history),
                    "best_val_score": fitted.best_score}
    stage, frame_model_metrics = None, {}
    if mode.second_stage:  # the frame model, fixed, embeds the fold; the temporal head trains on that
        if evaluation is not None:
            frame_model_metrics = evaluation.metrics(prefix="frame_model/test/")
        with times("second_stage"):
            stage = second_stage(cfg, fold, module, datamodule, best_path, work_dir)
        validation, predictions, evaluation = stage.validation, stage.predictions, stage.evaluation
        selected = {"best_epoch": stage.best_epoch, "epochs_trained": len(stage.history),
                    "best_val_score": stage.best_score}
    return Trained(module, datamodule, weights, mode, history, best_path, selected, validation, predictions,
                   evaluation, frame_model_metrics, stage)


def train_fold(cfg: DictConfig, fold: int, decisions: FoldDecisions, work_dir: Path,
               keep_model: bool = False, settings: DeviceSettings | None = None,
               callbacks: Sequence[pl.Callback] = ()) -> FoldResult:
    """Train on the fold's training subjects, select on its validation subjects, test once on its test subjects
    (`train`); choose the threshold, log and keep what the CV reads.

    `settings`: precision and channels_last as resolved on this device (`resolve_here` when None), tagged on the
    run. `callbacks` join the fit (the fold job's lease check). Logs epoch curves, test metrics and artifacts to the
    active MLflow run.
    """
    started = time.time()
    times = StepTimes()
    work_dir.mkdir(parents=True, exist_ok=True)
    with times("setup"):
        settings = settings or resolve_here(cfg, decisions)
        mlflow.set_tags(settings.tags())
        built = build_fold(cfg, fold, decisions, settings)
        module, datamodule, weights = built
        counts = parameter_counts(module.model)
        log.info("fold %d: %s, %d of %d parameters trainable (backbone %d of %d); augmentation: %s", fold,
                 module.finetune.name, counts["parameters_trainable"], counts["parameters_total"],
                 counts["backbone_parameters_trainable"], counts["backbone_parameters"], augmentation_label(cfg))
        mlflow.log_params(counts)
        mlflow.set_tags(finetune_tags(cfg))
        mlflow.log_input(subjects_dataset(split_videos(datamodule), f"{cfg.data.name}-{cfg.task.name}-fold{fold}"),
                         context="training")
    trained = train(cfg, fold, decisions, work_dir, settings, callbacks=callbacks, times=times, built=built)
    stage, history, selected = trained.stage, trained.history, trained.selected
    validation, predictions, evaluation = trained.validation, trained.predictions, trained.evaluation
    assert validation is not None and evaluation is not None and predictions is not None
    head = HeadConfig.from_config(cfg.model.head)
    head_size = stage.record["head_parameters"] if stage else sum(p.numel() for p in module.model.head.parameters())
    mlflow.log_params({"head": head.label, "head_parameters": head_size})
    with times("threshold"):  # the threshold sees the validation subjects only; the test videos get it as it is
        threshold, evaluation.video_predictions, decided, fallback = decide_fold(
            validation.video_predictions, evaluation.video_predictions, module.class_names, cfg.eval.threshold)
    metrics = {**evaluation.metrics(prefix="test/"), **{f"test/{k}": v for k, v in decided.items()},
               **selected, **trained.frame_model_metrics, **datamodule.protocol_metrics()}
    if np.isfinite(threshold):
        metrics["test/threshold"] = threshold
        # how much each rule's threshold moves over a bootstrap of the validation subjects (test/threshold_ci95_*)
        metrics.update({f"test/{k}": v for k, v in threshold_spread(
            validation.video_predictions, f"prob_{module.class_names[1]}").items()})
    videos = evaluation.video_predictions  # calibration of the video probabilities: test/video_brier, _ece
    metrics.update({f"test/video_{k}": v for k, v in calibration_metrics(
        videos["label"].to_numpy(), videos[[f"prob_{c}" for c in module.class_names]].to_numpy()).items()})
    if evaluation.video_predictions["subject_name"].nunique() == 1:  # leave one subject out: AUROC within a person
        metrics["test/within_subject_video_auroc"] = metrics["test/video_auroc"]
    graded = graded_scoring(get_task(cfg.task.name), OutputConfig.from_config(cfg.model.get("output")))
    if graded:  # MAE, kappa, Spearman within subject of the calls as made (test/video_mae, ...)
        metrics.update({f"test/{k}": v for k, v in fold_graded_metrics(videos, module.class_names).items()})
    out = work_dir / "artifacts"
    rule = rule_name(cfg.eval.threshold, len(module.class_names))
    with times("artifacts"):
        write_fold_artifacts(out, fold, module.class_names, predictions, evaluation, history,
                             datamodule.split_summary())
        if stage is not None:
            write_record(stage.record, out / TWO_STAGE_RECORD)
            pd.DataFrame(stage.history).to_csv(out / "head_training.csv", index=False)
        validation.video_predictions.to_csv(out / VAL_VIDEO_PREDICTIONS, index=False)
        if graded:
            write_level_confusion(decided_levels(videos, module.class_names), module.class_names, out,
                                  "confusion_levels", f"fold {fold}: videos by level, as called")
        mlflow.log_params({"threshold_rule": rule})
        mlflow.set_tag("threshold_rule", rule)
        log_threshold_fallback(fold, fallback)
        mlflow.log_metrics(metrics)
        fsync_tree(out)  # the local copies on disk before upload: the work folder is kept until the CV finishes
        mlflow.log_artifacts(str(out))
    if keep_model:
        with times("model_logging"):
            # the clip model of a two-stage head: the fold's frame backbone and its temporal head
            path = trained.keep(cfg, work_dir / Path(MODEL_ARTIFACT).name, fold=fold,
                                best_epoch=int(selected["best_epoch"]))
            mlflow.log_artifact(str(path), str(Path(MODEL_ARTIFACT).parent))
            log_fold_model(cfg, path, fold, list(module.class_names), weights, threshold, rule)
    mlflow.log_metrics(times.metrics())
    log.info("fold %d steps: %s", fold, times.line())
    return FoldResult(fold, metrics, predictions, evaluation.video_predictions, time.time() - started)


# ---------------------------------------------------------------------------------------------------------------
# The job: child-run bookkeeping around train_fold.

def result_from_run(client: MlflowClient, run) -> FoldResult:
    """A finished fold read back from its child run (metrics and prediction tables)."""
    run_id = run.info.run_id
    frames = pd.read_csv(client.download_artifacts(run_id, FRAME_PREDICTIONS))
    videos = pd.read_csv(client.download_artifacts(run_id, VIDEO_PREDICTIONS))
    seconds = ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000
    seed = run.data.tags.get("seed")
    return FoldResult(int(run.data.tags["fold"]), dict(run.data.metrics), frames, videos, seconds, run_id,
                      int(seed) if seed not in (None, "") else None)


def job_owner_tags() -> dict[str, str]:
    """Where a fold attempt runs: lets a later driver tell a live attempt from a dead one. The host is this machine's
    identity (host name, boot id, PID namespace: `fold_lease.machine_identity`), so that a process number is judged
    only where it means that process."""
    tags = {HOST_TAG: fold_lease.machine_identity(), PID_TAG: str(os.getpid())}
    slurm_job = fold_lease.own_slurm_job()
    if slurm_job:
        tags[SLURM_JOB_TAG] = slurm_job
    return tags


class ArtifactsNotStored(RuntimeError):
    """What a fold run logged is not in the store as written: the run is not marked FINISHED."""


def file_facts(path: Path) -> dict[str, int | str]:
    """A file's size and SHA-256, as a fold run's stored-artifacts record holds them."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def local_artifact_folder(artifact_uri: str) -> Path | None:
    """The folder of a file artifact store's run artifacts (file:// or a plain path); None for any other store."""
    parts = urlsplit(artifact_uri)
    if parts.scheme == "file":
        return Path(url2pathname(parts.path))
    return Path(artifact_uri) if not parts.scheme else None


def keep_only_artifacts(work_dir: Path) -> None:
    """A sealed fold's work folder keeps the local copies of what it stored (`artifacts/`, kilobytes) until the CV
    is FINISHED; its epoch checkpoints, kept model and embeddings (up to a gigabyte or more a fold: a LOSO CV of a
    ViT-B/16 would hold about 100 GB) are in the store or no longer needed, and go now."""
    for path in work_dir.iterdir() if work_dir.is_dir() else ():
        if path.name == "artifacts":
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def seal_fold(client: MlflowClient, run_id: str, work_dir: Path, keep_model: bool) -> dict[str, dict]:
    """Make what a finished fold run is read for safe before it is marked FINISHED: with a file artifact store the
    uploaded copies flushed to disk (the local ones were, before upload), then the prediction tables the CV
    aggregates and the kept model (when logged) read back from the store and compared with the local files by size
    and SHA-256. Returns that record (artifact path -> size, sha256); `ArtifactsNotStored` names a file that differs."""
    local = {name: work_dir / "artifacts" / name for name in SEALED}
    if keep_model:
        local[MODEL_ARTIFACT] = work_dir / Path(MODEL_ARTIFACT).name
    stored = local_artifact_folder(client.get_run(run_id).info.artifact_uri)
    if stored is not None and stored.is_dir():
        fsync_tree(stored, parents=2)  # the run's folder and its experiment's: where a new folder's entry lies
    record = {}
    with tempfile.TemporaryDirectory(prefix="painvit-seal-") as tmp:
        for name, path in local.items():
            written = file_facts(path)
            try:
                copy = Path(client.download_artifacts(run_id, name, tmp))
            except Exception as error:  # noqa: BLE001 - any store's "not there": said with the file's name
                raise ArtifactsNotStored(f"run {run_id}: {name} cannot be read back from the store: {error}") from error
            read = file_facts(copy)
            if read != written:
                raise ArtifactsNotStored(f"run {run_id}: {name} reads back as {read['size']} bytes, sha256 "
                                         f"{read['sha256']}; written as {written['size']} bytes, sha256 "
                                         f"{written['sha256']} ({path})")
            record[name] = written
    return record


def unreadable(client: MlflowClient, run: Run) -> str:
    """Why a FINISHED fold run can no longer be read ("" when it can): a file of its stored-artifacts record that is
    not in the store at the size it was stored with (a run from before that record: a missing prediction table)."""
    try:
        record = json.loads(run.data.tags.get(STORED_ARTIFACTS_TAG) or "{}")
    except json.JSONDecodeError:
        record = {}
    expected: dict[str, int | None] = ({name: int(facts["size"]) for name, facts in record.items()} if record
                                       else dict.fromkeys(SEALED))
    listed: dict[str, int | None] = {}
    for folder in sorted({str(Path(name).parent) for name in expected}):
        listed.update({info.path: info.file_size for info in
                       client.list_artifacts(run.info.run_id, None if folder == "." else folder) if not info.is_dir})
    problems = []
    for name, size in expected.items():
        if name not in listed:
            problems.append(f"{name} is missing")
        elif size is not None and listed[name] is not None and listed[name] != size:
            problems.append(f"{name} holds {listed[name]} bytes, {size} when it was stored")
    return "; ".join(problems)


def retire_unreadable(client: MlflowClient, runs: list[Run]) -> list[Run]:
    """The FINISHED fold runs among `runs` whose artifacts the store no longer holds (`unreadable`), each marked
    FAILED with the reason (tag `painvit.failed_reason`), so that its fold is trained again rather than counted done
    on results nobody can read."""
    retired = []
    for run in runs:
        if run.info.status != FINISHED:
            continue
        reason = unreadable(client, run)
        if reason:
            message = f"its artifacts are no longer in the store ({reason}): the fold is trained again"
            print(f"fold {run.data.tags.get(FOLD_TAG)}: finished run {run.info.run_id} marked FAILED: {message}",
                  flush=True)
            client.set_tag(run.info.run_id, FAILED_REASON_TAG, message)
            client.set_terminated(run.info.run_id, "FAILED")
            retired.append(run)
    return retired


def counted_attempts(client: MlflowClient, job: FoldJob) -> list[Run]:
    """The fold's attempts, newest first, with any FINISHED one whose artifacts are gone retired first."""
    runs = fold_runs(client, job.parent_run_id, job.fold, job.seed)
    return fold_runs(client, job.parent_run_id, job.fold, job.seed) if retire_unreadable(client, runs) else runs


def run_fold_job(job: FoldJob) -> FoldResult:
    """Run one fold under its own child run of `job.parent_run_id`; see the module docstring for the rules. A job
    whose attempt is taken over by another job (`fold_lease.LeaseLost`) leaves that attempt unfinished and waits
    for the fold like any other job: it returns the result of whichever attempt finishes it."""
    client = MlflowClient(job.tracking_uri)
    cfg = OmegaConf.create(job.config)
    # a lease in the store: a fold another machine trains now is waited for, a dead attempt replaced (fold_lease)
    lease_s = float(OmegaConf.select(cfg, "cv.lease_s", default=300))
    owner = fold_lease.new_owner()
    watch = fold_lease.Watch(lease_s)  # what this job has seen of other attempts, on its own clock
    while True:
        attempt, finished = fold_lease.acquire(client, job.parent_run_id, job.fold, job.seed, owner, lease_s,
                                               lambda: counted_attempts(client, job), watch=watch)
        if finished is not None:
            log.info("fold %d (seed %s) already has a finished run %s", job.fold, job.seed, finished.info.run_id)
            return result_from_run(client, finished)
        try:
            return train_attempt(client, job, cfg, attempt, owner, lease_s)
        except fold_lease.LeaseLost as lost:
            print(f"fold {job.fold}{'' if job.seed is None else f' (seed {job.seed})'}: {lost}; this job stopped "
                  f"without finishing it and waits for the fold", flush=True)


def train_attempt(client: MlflowClient, job: FoldJob, cfg: DictConfig, attempt: int, owner: str,
                  lease_s: float) -> FoldResult:
    """Attempt `attempt` of the fold, claimed by `owner`: its child run, trained under a heartbeat, sealed, FINISHED.
    `fold_lease.LeaseLost` when another job took it over meanwhile (the run is then left KILLED, never FINISHED)."""
    parent = client.get_run(job.parent_run_id)
    tags = {k: parent.data.tags.get(k, "") for k in ("model", "dataset", "protocol", "task", "subject_set", "seed")}
    if job.seed is not None:  # one of several training seeds: the fold is trained with it, and tagged so
        cfg.seed = job.seed
        tags["seed"] = str(job.seed)
    work_dir = Path(job.work_dir)
    mlflow.set_tracking_uri(job.tracking_uri)
    name = f"fold {job.fold}" + (f" seed {job.seed}" if job.seed is not None else "")
    run = mlflow.start_run(experiment_id=parent.info.experiment_id, run_name=name,
                           tags={**tags, PARENT_TAG: job.parent_run_id, RUN_KIND_TAG: FOLD_RUN,
                                 FOLD_TAG: str(job.fold), ATTEMPT_TAG: str(attempt),
                                 JOB_TRACKING_URI_TAG: redact_uri(job.store_uri or job.tracking_uri),
                                 **job_owner_tags(),
                                 **fold_lease.lease_tags(owner)})
    heartbeat = fold_lease.Heartbeat(client, run.info.run_id, lease_s / 5, owner)  # renewed while the fold trains
    try:
        with heartbeat:
            mlflow.log_params({"fold": job.fold, **({"seed": job.seed} if job.seed is not None else {})})
            device = training_device(cfg.trainer.accelerator)  # this node's device; no usable GPU asked for: an error
            settings = resolve_on_device(cfg, job.decisions, device.kind)  # decided where the device is known
            log.info("fold %d: %s; %s", job.fold, device.line, settings.line)
            mlflow.set_tags(device.tags)
            result = train_fold(cfg, job.fold, job.decisions, work_dir, keep_model=cfg.cv.log_models,
                                settings=settings, callbacks=[StopWhenLeaseLost(heartbeat)])
            heartbeat.check()
            stored = seal_fold(client, run.info.run_id, work_dir, keep_model=cfg.cv.log_models)
            mlflow.set_tag(STORED_ARTIFACTS_TAG, json.dumps(stored, sort_keys=True))
        heartbeat.confirm()  # the run read once more, the heartbeat stopped: a job taken over never finishes it
    except fold_lease.LeaseLost as lost:
        mlflow.set_tag(LEASE_LOST_TAG, str(lost))
        mlflow.end_run("KILLED")
        raise
    except BaseException as error:
        mlflow.log_text(traceback.format_exc(), "traceback.txt")
        interrupted = isinstance(error, KeyboardInterrupt | SystemExit)
        mlflow.end_run("KILLED" if interrupted else "FAILED")
        raise
    mlflow.end_run(FINISHED)
    keep_only_artifacts(work_dir)  # the rest of the folder goes once the CV is FINISHED (its aggregate step)
    result.run_id, result.seed = run.info.run_id, job.seed
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline fold-job <job.json>`: run one fold job (what the parallel launcher starts per fold)."""
    from pipeline.utils.logging_setup import setup_logging

    args = sys.argv[1:] if argv is None else argv
    setup_logging()
    run_fold_job(FoldJob.read(Path(args[0])))
    return 0

