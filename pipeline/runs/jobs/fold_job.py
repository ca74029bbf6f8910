"""One fold's training: the one path a fold of a cross-validation, the final model and a tuning trial share.

What the plan decides once for every fold travels in `FoldDecisions` (`pipeline.runs.jobs.fold_decisions`); what
depends on the device is resolved on the device the fold trains on (`settings_on_device`). A `FoldJob` holds plain
values only (the resolved config, the fold id, the parent run id, the tracking URI and a work folder), so it pickles
for submitit and writes as JSON for a subprocess; `pipeline.runs.jobs.fold_run.run_fold_job` runs it under a child
run of its own.

The steps, each a function: `build_fold` (model, data, LightningModule), `train` (the fit where the head mode fits,
`pipeline.runs.jobs.fold_fit`: select on the inner validation subjects, epoch checkpoints; the best checkpoint scored
once on the test subjects; a second stage where the mode has one), then in `train_fold` the threshold on the
validation videos, `fold_test_metrics`, `log_fold_artifacts` (plots and tables: `write_fold_artifacts`) and
`keep_fold_model` (the self-describing model file).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import mlflow
import numpy as np
import pandas as pd
import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf

from pipeline.data.datamodule import LoaderConfig, PainDataModule
from pipeline.data.embeddings import embedding_variant
from pipeline.data.personalise import refuse_unapplied
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
from pipeline.models.backbones import PainNet
from pipeline.models.embedding_cache import CacheSettings, ensure_embeddings
from pipeline.models.factory import create_model
from pipeline.models.finetune import FinetuneConfig, FinetuneStrategy, parameter_counts, strategy_for
from pipeline.models.lightning_module import OptimConfig, PainLightningModule
from pipeline.models.model_file import MODEL_ARTIFACT
from pipeline.models.ordinal import OutputConfig, task_levels
from pipeline.models.temporal_heads import ClipNet, HeadConfig
from pipeline.runs.jobs.fold_decisions import (  # noqa: F401  (plan_decisions, settings_on_device: as before)
    DecisionNotHonoured,
    FoldDecisions,
    plan_decisions,
    settings_here,
    settings_on_device,
)
from pipeline.runs.jobs.head_modes import FirstStage, HeadMode, head_mode
from pipeline.runs.jobs.sealing import FRAME_PREDICTIONS, VIDEO_PREDICTIONS
from pipeline.runs.jobs.step_times import StepTimes
from pipeline.runs.jobs.two_stage import RECORD as TWO_STAGE_RECORD
from pipeline.runs.jobs.two_stage import SecondStage, second_stage, write_record
from pipeline.runs.serving.mlflow_model import log_fold_model
from pipeline.runs.store.cv_runs import WhatTrains
from pipeline.runs.store.registry import log_subjects, split_videos
from pipeline.runs.store.run_record import RunRecord
from pipeline.runs.store.tracking import redact_uri, uri_has_credentials
from pipeline.utils.atomic_io import atomic_path, fsync_tree
from pipeline.utils.devices import DeviceSettings
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)
VAL_VIDEO_PREDICTIONS = "predictions_videos_val.csv"  # the best checkpoint on the validation subjects


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
    # the parent run's experiment and the tags its fold runs copy (model, dataset, ...), as the plan knows them;
    # empty (a job written before they travelled): read from the parent run
    experiment_id: str = ""
    parent_tags: dict = field(default_factory=dict)
    tool: ClassVar[str] = "fold-job"  # `python -m pipeline fold-job <job.json>` runs it in a process of its own

    @property
    def key(self) -> int:
        return self.fold

    @property
    def name(self) -> str:
        return f"fold {self.fold}" + (f" (seed {self.seed})" if self.seed is not None else "")

    def file(self, kind: str) -> Path:
        """Its spec ("json") or log ("log") beside the fold's folder."""
        return Path(self.work_dir).parent / f"fold_{self.fold}.{kind}"

    def run(self) -> FoldResult:
        from pipeline.runs.jobs.fold_run import run_fold_job  # it imports this module

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

    `settings`: the device-dependent settings (`settings_here` when None). `datamodule_class` lets the final model
    (`pipeline.deployment.final_model`) read its train / validation split the same way."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = get_task(cfg.task.name)
    trains = WhatTrains.from_config(cfg)
    finetune = trains.finetune
    mode = head_mode(check_head(trains))
    # a frozen backbone's features are the same in every fold: read them from the embedding cache (built if missing)
    cached = finetune.reads_cache
    strategy = strategy_for(finetune, embeddings=cached)
    channels_last = not cached and (settings or settings_here(decisions, cfg.trainer.channels_last,
                                                              cfg.trainer.accelerator)).channels_last
    # end to end: the backbone runs on every frame of a clip and trains through the temporal head
    n_levels = task_levels(task, trains.output)  # a graded task's, if ordinal
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
            personalise=trains.personalise)
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


def check_head(trains: WhatTrains) -> HeadConfig:
    """The head, checked against the fine-tuning strategy (also before a CV plans anything)."""
    head, finetune = trains.head, trains.finetune
    # applied to a fixed backbone's cached embeddings only (under a frame head or a two-stage head's clips)
    refuse_unapplied(trains.personalise, reads_cache=finetune.reads_cache)
    if head.fit == "in_memory" and not finetune.reads_cache:
        raise ValueError(f"model.head.fit=in_memory fits the linear head on a fixed backbone's cached embeddings "
                         f"(model.finetune=frozen, cache.embeddings=true); this run has model.finetune="
                         f"{finetune.label} and cache.embeddings={finetune.cache_embeddings}")
    if head.end_to_end and finetune.backbone_fixed:
        raise ValueError("model.head.mode=end_to_end trains the backbone through the head, but model.finetune=frozen "
                         "fixes it: a frozen backbone's head over time is model.head.mode=two_stage (it reads cached "
                         "embeddings and skips the first stage)")
    return head


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
        record.set_tags({"threshold_fallback": fallback})


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
          built: tuple[PainLightningModule, PainDataModule, dict] | None = None,
          record: RunRecord | None = None) -> Trained:
    """The one training path of a fold, the final model and a tuning trial: build (`build_fold`, through the model
    factory), fit and select where the head mode fits (its `fit`: Lightning's `fit_fold`, or in memory), score the
    best on the splits in `scored` (`val`: re-validated for the threshold, `test`: tested once), then the second stage
    where the mode has one (its head's validation and test scores replace the frame model's).

    `datamodule_class`: the subjects' roles (a fold's, `final_model.FinalDataModule`'s, a study's); `callbacks` join
    the fit (a lease check, a trial's pruning); `built`: what `build_fold` returned, where the caller logged it;
    `record`: where a fit that logs its epochs at its end (in memory) gathers them (None: the active MLflow run)."""
    times = times or StepTimes()
    module, datamodule, weights = built or build_fold(cfg, fold, decisions, settings, datamodule_class)
    mode = head_mode(HeadConfig.from_config(cfg.model.head))
    first = FirstStage()
    if mode.trains_first_stage(FinetuneConfig.from_config(cfg)):  # a frame model, or an end-to-end clip model
        first = mode.fit(cfg, module, datamodule, work_dir, settings.precision, callbacks, scored, times, record)
    validation, predictions, evaluation = first.validation, first.predictions, first.evaluation
    selected = first.selected
    stage, frame_model_metrics = None, {}
    if mode.second_stage:  # the frame model, fixed, embeds the fold; the temporal head trains on that
        if evaluation is not None:
            frame_model_metrics = evaluation.metrics(prefix="frame_model/test/")
        with times("second_stage"):
            stage = second_stage(cfg, fold, module, datamodule, first.best_path, work_dir)
        validation, predictions, evaluation = stage.validation, stage.predictions, stage.evaluation
        selected = {"best_epoch": stage.best_epoch, "epochs_trained": len(stage.history),
                    "best_val_score": stage.best_score}
    return Trained(module, datamodule, weights, mode, first.history, first.best_path, selected, validation,
                   predictions, evaluation, frame_model_metrics, stage)


def train_fold(cfg: DictConfig, fold: int, decisions: FoldDecisions, work_dir: Path,
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
    trains = WhatTrains.from_config(cfg)
    with times("setup"):
        settings = settings or settings_here(decisions, cfg.trainer.channels_last, cfg.trainer.accelerator)
        built = set_up_fold(cfg, fold, decisions, settings, trains, record)
    trained = train(cfg, fold, decisions, work_dir, settings, callbacks=callbacks, times=times, built=built,
                    record=record)
    validation, evaluation = trained.validation, trained.evaluation
    assert validation is not None and evaluation is not None and trained.predictions is not None
    class_names = trained.module.class_names
    record.log_params({"head": trained.mode.head.label, "head_parameters": head_parameters(trained)})
    with times("threshold"):  # the threshold sees the validation subjects only; the test videos get it as it is
        threshold, evaluation.video_predictions, decided, fallback = decide_fold(
            validation.video_predictions, evaluation.video_predictions, class_names, cfg.eval.threshold)
    metrics = fold_test_metrics(trained, threshold, decided, trains.graded)
    rule = rule_name(cfg.eval.threshold, len(class_names))
    with times("artifacts"):
        log_fold_artifacts(fold, trained, work_dir / "artifacts", metrics, rule, fallback, trains.graded,
                           bool(cfg.cv.fold_plots), record)
    if keep_model:
        with times("model_logging"):
            keep_fold_model(cfg, fold, trained, work_dir, threshold, rule)
    record.log_metrics(times.metrics())
    if own_record:
        record.flush()
    log.info("fold %d steps: %s", fold, times.line())
    return FoldResult(fold, metrics, trained.predictions, evaluation.video_predictions, time.time() - started)


def set_up_fold(cfg: DictConfig, fold: int, decisions: FoldDecisions, settings: DeviceSettings,
                trains: WhatTrains, record: RunRecord) -> tuple[PainLightningModule, PainDataModule, dict]:
    """`build_fold`, with what it built logged on the fold run (`record`): the device settings, the parameters
    trainable, what trains (`trains`: the fine-tuning strategy, the augmentation) and the subjects' videos (an MLflow
    dataset, stored now)."""
    record.set_tags(settings.tags())
    built = build_fold(cfg, fold, decisions, settings)
    module, datamodule, _ = built
    counts = parameter_counts(module.model)
    log.info("fold %d: %s, %d of %d parameters trainable (backbone %d of %d); augmentation: %s", fold,
             module.finetune.name, counts["parameters_trainable"], counts["parameters_total"],
             counts["backbone_parameters_trainable"], counts["backbone_parameters"], trains.augmentation_label)
    record.log_params(counts)
    record.set_tags(trains.tags())
    log_subjects(record.client, record.run_id, split_videos(datamodule), f"{cfg.data.name}-{cfg.task.name}-fold{fold}")
    return built


def head_parameters(trained: Trained) -> int:
    """The size of the head that is kept: a two-stage head's (its record), else the network's own head."""
    if trained.stage is not None:
        return trained.stage.record["head_parameters"]
    return sum(p.numel() for p in trained.module.model.head.parameters())


def fold_test_metrics(trained: Trained, threshold: float, decided: dict[str, float], graded: bool) -> dict:
    """The fold run's metrics: the test split's scores (at the fold's threshold too), what was selected, the frame
    model's of a two-stage head, the protocol's; the threshold's spread, calibration, and where `graded` (a graded
    task, `ordinal.graded_scoring`) its levels."""
    validation, evaluation, class_names = trained.validation, trained.evaluation, trained.module.class_names
    assert validation is not None and evaluation is not None
    metrics = {**evaluation.metrics(prefix="test/"), **{f"test/{k}": v for k, v in decided.items()},
               **trained.selected, **trained.frame_model_metrics, **trained.datamodule.protocol_metrics()}
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


def log_fold_artifacts(fold: int, trained: Trained, out: Path, metrics: dict, rule: str, fallback: str,
                       graded: bool, plots: bool, record: RunRecord) -> None:
    """The fold's plots (`plots`: cv.fold_plots) and tables (`write_fold_artifacts`, a second stage's record and
    epochs, the validation videos, a graded task's level confusion) written to `out`, flushed and stored; the
    metrics and the rule gathered in `record`."""
    validation, evaluation, class_names = trained.validation, trained.evaluation, trained.module.class_names
    assert validation is not None and evaluation is not None and trained.predictions is not None
    write_fold_artifacts(out, fold, class_names, trained.predictions, evaluation, trained.history,
                         trained.datamodule.split_summary(), plots)
    if trained.stage is not None:
        write_record(trained.stage.record, out / TWO_STAGE_RECORD)
        pd.DataFrame(trained.stage.history).to_csv(out / "head_training.csv", index=False)
    validation.video_predictions.to_csv(out / VAL_VIDEO_PREDICTIONS, index=False)
    if graded:
        write_level_confusion(decided_levels(evaluation.video_predictions, class_names), class_names, out,
                              "confusion_levels", f"fold {fold}: videos by level, as called", plot=plots)
    record.log_params({"threshold_rule": rule})
    record.set_tags({"threshold_rule": rule})
    log_threshold_fallback(fold, fallback, record)
    record.log_metrics(metrics)
    fsync_tree(out)  # the local copies on disk before upload: the work folder is kept until the CV finishes
    record.log_artifacts(out)


def keep_fold_model(cfg: DictConfig, fold: int, trained: Trained, work_dir: Path, threshold: float,
                    rule: str) -> None:
    """The fold's network as its head mode keeps it (the clip model of a two-stage head: the fold's frame backbone
    and its temporal head), a self-describing file logged beside the fold's MLflow model."""
    path = trained.keep(cfg, work_dir / Path(MODEL_ARTIFACT).name, fold=fold,
                        best_epoch=int(trained.selected["best_epoch"]))
    mlflow.log_artifact(str(path), str(Path(MODEL_ARTIFACT).parent))
    log_fold_model(cfg, path, fold, list(trained.module.class_names), trained.weights, threshold, rule)
