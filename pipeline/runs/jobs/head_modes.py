"""How a network's head trains: one small policy per head mode, in a registry (`HEAD_MODES`, name -> class) that the
rest of the code asks, as fine-tuning strategies are (`pipeline.models.finetune`), so that the training path
(`fold_job.train`), the plan, a trial and the final model never branch on the mode.

- `FrameHead` (`model.head.name=linear`, `model.head.fit=lightning`): the frame model (backbone + linear head) trains
  on crops; a video's score aggregates its crops' (`trainer.aggregation`). What is kept: the best checkpoint's frame
  model.
- `InMemoryProbe` (`model.head.fit=in_memory`): the frame model's linear head on a fixed backbone's cached
  embeddings, fitted by the same recipe in a plain loop over the fold's tensors (`pipeline.models.probe_training`),
  no Trainer and no epoch checkpoint. What is kept: the best epoch's frame model, from memory.
- `TwoStageHead` (a temporal head, `model.head.mode=two_stage`): the frame model trains first, unless its backbone
  is fixed (`model.finetune=frozen`: nothing to fine-tune); then the temporal head trains on that frame model's
  embeddings (`pipeline.runs.jobs.two_stage`). What is kept: the clip model of the frame backbone and the trained head.
- `EndToEndHead` (`model.head.mode=end_to_end`): the clip model (`ClipNet`) trains through its backbone on clips; it
  scores a video once, so nothing is left to aggregate. What is kept: the best checkpoint's clip model.

A mode is named by `model.head.fit` for the linear head and by `model.head.mode` for a temporal head (`head_mode`).
A policy answers what the rest asks: whether the strategy allows it (`check`), which temporal head the factory builds
into the network (`network_head`), whether the data are clips (`clips`), how crops' scores are aggregated
(`aggregation`), what augmentation training sees (`augmentation`), how a fold trains and scores the splits (`train`:
its `fit`, a Lightning fit or in memory, and what follows), which network is kept (`keep`, `keeps_clip_model`) and
what a tuning trial scores (`trial_value`). A new mode is one subclass registered with `@register_head_mode`, in any
module imported before the config is read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import mlflow
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric

from pipeline.data.clips import clip_spacing_s
from pipeline.data.datamodule import PainDataModule
from pipeline.models.factory import clip_model
from pipeline.models.finetune import FinetuneConfig
from pipeline.models.fold_result import FoldResult
from pipeline.models.lightning_module import PainLightningModule
from pipeline.models.model_file import model_meta, save_model_file
from pipeline.models.probe_training import ProbeTraining, fit_probe, score_test
from pipeline.models.temporal_heads import ClipNet, HeadConfig
from pipeline.runs.jobs.fold_fit import fit_fold
from pipeline.runs.jobs.step_times import StepTimes
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.two_stage import second_stage
from pipeline.runs.store.run_record import RunRecord


class HeadMode:
    """A head mode's policy; its defaults are the frame model's (`FrameHead`), which the other modes change."""

    name: ClassVar[str] = "lightning"  # its registry key: model.head.fit (the linear head) or model.head.mode
    temporal: ClassVar[bool] = False  # a mode of a temporal head (model.head.name other than linear)
    clips: ClassVar[bool] = False  # the datamodule serves whole clips (one item per video), not crops
    keeps_clip_model: ClassVar[bool] = False  # what is kept scores a window of crops (a clip model), not one crop
    # its fit logs each epoch as it ends (Lightning's); else its epochs are logged once it returns (`log_history`)
    fit_logs_epochs: ClassVar[bool] = True

    def __init__(self, head: HeadConfig) -> None:
        self.head = head

    def check(self, finetune: FinetuneConfig) -> None:
        """Refuse a fine-tuning strategy this mode cannot train under (before a CV plans anything)."""

    def network_head(self) -> HeadConfig | None:
        """The temporal head the factory builds into the trained network (None: a frame model)."""
        return None

    def aggregation(self, configured: str) -> str:
        """How a video's score is made of its crops' (`configured`: `trainer.aggregation`)."""
        return configured

    def augmentation(self, finetune: FinetuneConfig, cache_views: int) -> tuple[bool, str]:
        """Whether training applies the `augment.*` settings, and what it saw, in words: the images, or a fixed
        backbone's cached embeddings (the plain one, `cache.views=0`, or augmented views drawn with `augment.*`)."""
        if finetune.reads_cache:
            if cache_views == 0:
                return False, "none (frozen embeddings, cache.views=0; augment.* not applied)"
            return True, (f"{cache_views} augmented view(s) per crop (frozen embeddings, cache.views={cache_views}, "
                          f"drawn with augment.*)")
        return True, "augment.* on the images"

    def train(self, training: TrainingSettings, built: BuiltFold, work_dir: Path, precision: str, callbacks: Sequence,
              scored: Sequence[str], times: StepTimes) -> FoldResult:
        """The fold's training under this mode: the fit (`fit`), its best scored on the splits in `scored`."""
        return self.fit(training, built.module, built.datamodule, work_dir, precision, callbacks, scored, times)

    def fit(self, training: TrainingSettings, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
            precision: str, callbacks: Sequence, scored: Sequence[str], times: StepTimes) -> FoldResult:
        """A Lightning fit selected on the validation subjects, the best checkpoint re-validated (`val` in `scored`:
        for the threshold) and tested once (`test`): `fold_fit.fit_fold`."""
        return fit_fold(training, module, datamodule, work_dir, precision, callbacks, scored, times)

    def keep(self, training: TrainingSettings, built: BuiltFold, result: FoldResult, path: Path, **extra) -> Path:
        """The network to keep, as a self-describing file: the best checkpoint's."""
        assert result.best_path is not None, "a Lightning fit always selects a checkpoint"
        return save_frame_model(training, built.module, result.best_path, built.weights, path,
                                kept_loader(training, built.datamodule, self.keeps_clip_model), **extra)

    def trial_value(self, result: FoldResult, monitor_mode: str) -> float:
        """A tuning trial's value in the study's direction (`trainer.monitor_mode`): the best validation score of
        what the CV would keep (the monitored metric, already in that direction)."""
        return float(result.best_score)


@dataclass
class BuiltFold:
    """What `fold_job.build_fold` builds for one training: the LightningModule (a fresh network in it), the data of
    the subjects' roles, the initial weights' provenance as tags, and the head mode's policy."""

    module: PainLightningModule
    datamodule: PainDataModule
    weights: dict[str, str]
    mode: HeadMode


HEAD_MODES: dict[str, type[HeadMode]] = {}


def register_head_mode(mode: type[HeadMode]) -> type[HeadMode]:
    """Add a head mode under its `name` (a class decorator); a name already taken is an error."""
    if mode.name in HEAD_MODES:
        raise ValueError(f"a head mode named {mode.name!r} exists already ({HEAD_MODES[mode.name].__name__})")
    HEAD_MODES[mode.name] = mode
    return mode


def head_mode(head: HeadConfig) -> HeadMode:
    """The policy of `model.head`: the mode `model.head.mode` names for a temporal head, `model.head.fit` for the
    linear one; the one place the head's mode is read."""
    setting, key = ("mode", head.mode) if head.temporal else ("fit", head.fit)
    known = [name for name, mode in HEAD_MODES.items() if mode.temporal == head.temporal]
    if key not in known:
        raise ValueError(f"model.head.{setting}={key!r}: expected one of {', '.join(known)}")
    if head.temporal and head.fit != FrameHead.name:
        raise ValueError(f"model.head.fit={head.fit} fits the linear frame head; a temporal head ({head.name}) on a "
                         f"fixed backbone trains in memory already (model.head.mode=two_stage)")
    return HEAD_MODES[key](head)


@register_head_mode
class FrameHead(HeadMode):
    """The frame model: a linear head per crop, the crops' scores aggregated per video."""


@register_head_mode
class InMemoryProbe(FrameHead):
    """The frame model's head on cached embeddings, fitted in memory (`probe_training.fit_probe`): the Lightning
    fit's recipe without a Trainer; the best epoch's weights stay in the module, which is what is kept."""

    name = "in_memory"
    fit_logs_epochs = False

    def check(self, finetune: FinetuneConfig) -> None:
        if not finetune.reads_cache:
            raise ValueError(f"model.head.fit=in_memory fits the linear head on a fixed backbone's cached embeddings "
                             f"(model.finetune=frozen, cache.embeddings=true); this run has model.finetune="
                             f"{finetune.label} and cache.embeddings={finetune.cache_embeddings}")

    def fit(self, training: TrainingSettings, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
            precision: str, callbacks: Sequence, scored: Sequence[str], times: StepTimes) -> FoldResult:
        if precision not in ("32", "32-true"):  # a head on float32 embeddings: nothing for a lower precision to speed
            raise ValueError(f"model.head.fit=in_memory trains in float32; trainer.precision resolved to {precision}")
        trainer = training.trainer
        if trainer.limits:
            raise ValueError(f"model.head.fit=in_memory fits on every batch; unset {', '.join(trainer.limits)}")
        settings = ProbeTraining(trainer.max_epochs, trainer.patience, trainer.monitor, trainer.monitor_mode,
                                 trainer.gradient_clip_val)
        with times("fit"):
            result = fit_probe(module, datamodule, settings, callbacks)  # its validation: the best epoch's, as scored
        if "val" not in scored:
            result.validation = None
        if "test" in scored:
            with times("test"):
                result.frame_predictions, result.evaluation = score_test(module, datamodule)
        return result

    def keep(self, training: TrainingSettings, built: BuiltFold, result: FoldResult, path: Path, **extra) -> Path:
        return save_frame_model(training, built.module, None, built.weights, path,
                                kept_loader(training, built.datamodule, self.keeps_clip_model), **extra)


@register_head_mode
class TwoStageHead(HeadMode):
    """The frame model first (unless its backbone is fixed), then the temporal head on its embeddings."""

    name = "two_stage"
    temporal = True
    keeps_clip_model = True

    def augmentation(self, finetune: FinetuneConfig, cache_views: int) -> tuple[bool, str]:
        if finetune.backbone_fixed:
            return False, "none (frozen backbone: the two-stage head trains on plain embeddings; augment.* not applied)"
        return True, "augment.* on the frame model's images (the two-stage head trains on plain embeddings)"

    def train(self, training: TrainingSettings, built: BuiltFold, work_dir: Path, precision: str, callbacks: Sequence,
              scored: Sequence[str], times: StepTimes) -> FoldResult:
        """The frame model's fit (skipped for a fixed backbone), then the second stage: the frame model, fixed, embeds
        the fold; the temporal head trains on that, and its validation and test scores replace the frame model's."""
        first = FoldResult(built.datamodule.fold)
        if not built.module.finetune.backbone_fixed:
            first = self.fit(training, built.module, built.datamodule, work_dir, precision, callbacks, scored, times)
        with times("second_stage"):
            return second_stage(training, first.fold, built.module, built.datamodule, first, work_dir)

    def keep(self, training: TrainingSettings, built: BuiltFold, result: FoldResult, path: Path, **extra) -> Path:
        assert result.head is not None
        return save_clip_model(training, built.module, result.head, built.weights, path,
                               kept_loader(training, built.datamodule, self.keeps_clip_model), **extra)

    def trial_value(self, result: FoldResult, monitor_mode: str) -> float:
        """The head scores higher-better (validation video AUROC, or minus the loss): negated for a study that
        minimises."""
        score = float(result.best_score)
        return -score if monitor_mode == "min" else score


@register_head_mode
class EndToEndHead(HeadMode):
    """The clip model trained through its backbone, on clips."""

    name = "end_to_end"
    temporal = True
    clips = True
    keeps_clip_model = True

    def check(self, finetune: FinetuneConfig) -> None:
        if finetune.backbone_fixed:
            raise ValueError("model.head.mode=end_to_end trains the backbone through the head, but model.finetune="
                             "frozen fixes it: a frozen backbone's head over time is model.head.mode=two_stage (it "
                             "reads cached embeddings and skips the first stage)")

    def network_head(self) -> HeadConfig | None:
        return self.head

    def aggregation(self, configured: str) -> str:
        return "mean"  # a clip model predicts once per video: nothing is left to aggregate


def kept_loader(training: TrainingSettings, datamodule: PainDataModule, clips: bool) -> dict:
    """The loader settings a kept model records; a clip model's (`clips`) with its training clips' spacing in
    seconds."""
    loader = dict(training.loader_record)
    if clips:
        loader["clip_spacing_s"] = clip_spacing_s(datamodule.frames("train"), training.clip_frames)
    return loader


def log_history(history: list[dict], record: RunRecord | None) -> None:
    """Every epoch's metrics (step = epoch), as a Lightning fit logs them epoch by epoch: gathered in `record`, or
    without one on the active MLflow run in one request."""
    if record is not None:
        for row in history:
            record.log_metrics({name: value for name, value in row.items() if name != "epoch"}, int(row["epoch"]))
        return
    run = mlflow.active_run()
    if run is None or not history:
        return
    stamp = int(time.time() * 1000)
    metrics = [Metric(name, float(value), stamp, int(row["epoch"])) for row in history
               for name, value in row.items() if name != "epoch"]
    MlflowClient().log_batch(run.info.run_id, metrics=metrics)


def save_frame_model(training: TrainingSettings, module: PainLightningModule, best_path: str | None, weights: dict,
                     path: Path, loader: dict, **extra) -> Path:
    """The best checkpoint's network as a self-describing file (`pipeline.models.model_file`); `best_path` None:
    the module holds the best weights already (an in-memory fit)."""
    if best_path is not None:
        state = torch.load(best_path, map_location="cpu", weights_only=True)["state_dict"]
        module.load_state_dict(state, strict=module.strict_loading)  # a fixed backbone is not in the checkpoint
    net = module.finetune.for_keeping(module.model)  # LoRA: the adapters merged, a plain PainNet (or ClipNet)
    if isinstance(net, ClipNet):  # an end-to-end clip model: its head's settings travel in its meta
        extra["head"] = dict(training.head_record)
    meta = model_meta(net, model_name=training.model_name, img_size=training.img_size,
                      class_names=list(module.class_names), task=training.task.name, loader=loader, weights=weights,
                      finetune=training.finetune.label, **training.output.meta(), **training.personalise.meta(),
                      **extra)
    return save_model_file(net, meta, path)


def save_clip_model(training: TrainingSettings, module: PainLightningModule, trained: ClipNet, weights: dict,
                    path: Path, loader: dict, **extra) -> Path:
    """A two-stage fold's clip model (`ClipNet`) as a self-describing file: the frame backbone as its strategy keeps
    it (`for_keeping`, as `save_frame_model` does: LoRA's adapters merged into a plain backbone, which an unmerged one
    is not, so it would not load), the trained temporal head, and the head's settings in its meta."""
    frame_net = module.finetune.for_keeping(module.model)  # the best checkpoint's, as second_stage loaded it
    net = clip_model(frame_net.backbone, trained.head)
    meta = model_meta(net, model_name=training.model_name, img_size=training.img_size,
                      class_names=list(module.class_names), task=training.task.name, loader=loader, weights=weights,
                      finetune=training.finetune.label, **training.output.meta(), **training.personalise.meta(),
                      head=dict(training.head_record), **extra)
    return save_model_file(net, meta, path)
