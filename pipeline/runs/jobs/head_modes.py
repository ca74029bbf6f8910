"""How a network's head trains: one small policy per head mode, chosen from `model.head` once, as fine-tuning
strategies are (`pipeline.models.finetune`), so that the training path (`fold_job.train`) does not branch on the mode.

- `FrameHead` (`model.head.name=linear`): the frame model (backbone + linear head) trains on crops; a video's score
  aggregates its crops' (`trainer.aggregation`). What is kept: the best checkpoint's frame model.
- `TwoStageHead` (a temporal head, `model.head.mode=two_stage`): the frame model trains first, unless its backbone
  is fixed (`model.finetune=frozen`: nothing to fine-tune); then the temporal head trains on that frame model's
  embeddings (`pipeline.runs.jobs.two_stage`). What is kept: the clip model of the frame backbone and the trained head.
- `EndToEndHead` (`model.head.mode=end_to_end`): the clip model (`ClipNet`) trains through its backbone on clips; it
  scores a video once, so nothing is left to aggregate. What is kept: the best checkpoint's clip model.
- `InMemoryProbe` (`model.head.fit=in_memory`): the frame model's linear head on a fixed backbone's cached
  embeddings, fitted by the same recipe in a plain loop over the fold's tensors (`pipeline.models.probe_training`),
  no Trainer and no epoch checkpoint. What is kept: the best epoch's frame model, from memory.

A policy answers what the training path asks: which temporal head the factory builds into the network
(`network_head`), whether the data are clips (`clips`), how crops' scores are aggregated (`aggregation`), whether a
first stage trains the network (`trains_first_stage`), how it fits and scores the splits (`fit`: a Lightning fit, or
in memory), whether a second stage follows (`second_stage`), and which network is kept (`keep`). A new mode is one
new subclass here and one line in `head_mode`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
import pandas as pd
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric
from omegaconf import DictConfig, OmegaConf

from pipeline.data.clips import clip_spacing_s
from pipeline.data.datamodule import PainDataModule
from pipeline.data.personalise import PersonaliseConfig
from pipeline.evaluation.metrics import Evaluation
from pipeline.models.factory import clip_model
from pipeline.models.finetune import FinetuneConfig
from pipeline.models.lightning_module import PainLightningModule
from pipeline.models.model_file import model_meta, save_model_file
from pipeline.models.ordinal import OutputConfig
from pipeline.models.probe_training import ProbeTraining, fit_probe, score_test
from pipeline.models.temporal_heads import ClipNet, HeadConfig
from pipeline.runs.jobs.fold_fit import fit_fold, test_fold, validate_fold
from pipeline.runs.jobs.step_times import StepTimes
from pipeline.runs.jobs.two_stage import SecondStage
from pipeline.runs.store.run_record import RunRecord

if TYPE_CHECKING:
    from pipeline.runs.jobs.fold_job import Trained


@dataclass
class FirstStage:
    """What the first stage's fit kept: its best checkpoint (None: in memory, or no fit), its epochs, what was
    selected, and the kept network's scores on the splits asked for (None where not scored)."""

    best_path: str | None = None
    history: list[dict] = field(default_factory=list)
    selected: dict[str, float] = field(default_factory=dict)  # best_epoch, epochs_trained, best_val_score
    validation: Evaluation | None = None
    predictions: pd.DataFrame | None = None  # test predictions, per crop (per video for clips)
    evaluation: Evaluation | None = None


class HeadMode:
    """A head mode's policy; its defaults are the frame model's (`FrameHead`), which the other modes change."""

    name = "frame"
    clips = False  # the datamodule serves whole clips (one item per video), not crops
    second_stage = False  # a temporal head trains after the fit, on the fitted frame model's embeddings

    def __init__(self, head: HeadConfig) -> None:
        self.head = head

    def network_head(self) -> HeadConfig | None:
        """The temporal head the factory builds into the trained network (None: a frame model)."""
        return None

    def trains_first_stage(self, finetune: FinetuneConfig) -> bool:
        """Whether a Lightning fit trains the network built here."""
        return True

    def aggregation(self, cfg: DictConfig) -> str:
        """How a video's score is made of its crops' (`trainer.aggregation`)."""
        return str(cfg.trainer.aggregation)

    def fit(self, cfg: DictConfig, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
            precision: str, callbacks: Sequence, scored: Sequence[str], times: StepTimes,
            record: RunRecord | None) -> FirstStage:
        """The first stage: a Lightning fit selected on the validation subjects (`fit_fold`: it logs each epoch as it
        ends), the best checkpoint re-validated (`val` in `scored`: for the threshold) and tested once (`test`).
        `record`: where a fit that logs its epochs at its end gathers them (None: the active MLflow run)."""
        with times("fit"):
            fitted = fit_fold(cfg, module, datamodule, work_dir, precision, callbacks)
        stage = FirstStage(fitted.best_path, fitted.history, {"best_epoch": fitted.best_epoch,
                                                               "epochs_trained": len(fitted.history),
                                                               "best_val_score": fitted.best_score})
        if "val" in scored:
            with times("validation_repass"):
                stage.validation = validate_fold(fitted, module, datamodule)
        if "test" in scored:
            with times("test"):
                stage.predictions, stage.evaluation = test_fold(fitted, module, datamodule)
        return stage

    def keep(self, cfg: DictConfig, trained: Trained, path: Path, **extra) -> Path:
        """The network to keep, as a self-describing file: the best checkpoint's."""
        assert trained.best_path is not None, "a mode without a second stage always fits"
        return keep_fold_model(cfg, trained.module, trained.best_path, trained.weights, path,
                               kept_loader(cfg, trained.datamodule), **extra)


class FrameHead(HeadMode):
    """The frame model: a linear head per crop, the crops' scores aggregated per video."""


class InMemoryProbe(FrameHead):
    """The frame model's head on cached embeddings, fitted in memory (`probe_training.fit_probe`): the Lightning
    fit's recipe without a Trainer; the best epoch's weights stay in the module, which is what is kept."""

    name = "in_memory_probe"

    def fit(self, cfg: DictConfig, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
            precision: str, callbacks: Sequence, scored: Sequence[str], times: StepTimes,
            record: RunRecord | None) -> FirstStage:
        if precision not in ("32", "32-true"):  # a head on float32 embeddings: nothing for a lower precision to speed
            raise ValueError(f"model.head.fit=in_memory trains in float32; trainer.precision resolved to {precision}")
        limits = {k: cfg.trainer[k] for k in ("limit_train_batches", "limit_val_batches") if cfg.trainer[k] is not None}
        if limits:
            raise ValueError(f"model.head.fit=in_memory fits on every batch; unset {', '.join(limits)}")
        settings = ProbeTraining(int(cfg.trainer.max_epochs), int(cfg.trainer.patience), str(cfg.trainer.monitor),
                                 str(cfg.trainer.monitor_mode), cfg.trainer.gradient_clip_val)
        with times("fit"):
            fitted = fit_probe(module, datamodule, settings, callbacks)
        stage = FirstStage(None, fitted.history, {"best_epoch": fitted.best_epoch,
                                                  "epochs_trained": len(fitted.history),
                                                  "best_val_score": fitted.best_score})
        if "val" in scored:
            stage.validation = fitted.validation  # the best epoch's, as it was scored then
        if "test" in scored:
            with times("test"):
                stage.predictions, stage.evaluation = score_test(module, datamodule)
        log_history(fitted.history, record)
        return stage

    def keep(self, cfg: DictConfig, trained: Trained, path: Path, **extra) -> Path:
        return keep_fold_model(cfg, trained.module, None, trained.weights, path, kept_loader(cfg, trained.datamodule),
                               **extra)


class TwoStageHead(HeadMode):
    """The frame model first (unless its backbone is fixed), then the temporal head on its embeddings."""

    name = "two_stage"
    second_stage = True

    def trains_first_stage(self, finetune: FinetuneConfig) -> bool:
        return not finetune.backbone_fixed

    def keep(self, cfg: DictConfig, trained: Trained, path: Path, **extra) -> Path:
        assert trained.stage is not None
        return keep_clip_model(cfg, trained.module, trained.stage, trained.weights, path,
                               kept_loader(cfg, trained.datamodule), **extra)


class EndToEndHead(HeadMode):
    """The clip model trained through its backbone, on clips."""

    name = "end_to_end"
    clips = True

    def network_head(self) -> HeadConfig | None:
        return self.head

    def aggregation(self, cfg: DictConfig) -> str:
        return "mean"  # a clip model predicts once per video: nothing is left to aggregate


def head_mode(head: HeadConfig) -> HeadMode:
    """The policy of `model.head` (checked): the one place the head's mode is read."""
    if head.fit == "in_memory":
        return InMemoryProbe(head)
    if head.end_to_end:
        return EndToEndHead(head)
    if head.two_stage:
        return TwoStageHead(head)
    return FrameHead(head)


def kept_loader(cfg: DictConfig, datamodule: PainDataModule) -> dict:
    """The loader settings a kept model records; a clip model's with its training clips' spacing in seconds."""
    loader = OmegaConf.to_container(cfg.loader)
    if HeadConfig.from_config(cfg.model.head).temporal:
        loader["clip_spacing_s"] = clip_spacing_s(datamodule.frames("train"), int(cfg.loader.clip_frames))
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


def keep_fold_model(cfg: DictConfig, module: PainLightningModule, best_path: str | None, weights: dict, path: Path,
                    loader: dict, **extra) -> Path:
    """The best checkpoint's network as a self-describing file (`pipeline.models.model_file`); `best_path` None:
    the module holds the best weights already (an in-memory fit)."""
    if best_path is not None:
        state = torch.load(best_path, map_location="cpu", weights_only=True)["state_dict"]
        module.load_state_dict(state, strict=module.strict_loading)  # a fixed backbone is not in the checkpoint
    net = module.finetune.for_keeping(module.model)  # LoRA: the adapters merged, a plain PainNet (or ClipNet)
    if isinstance(net, ClipNet):  # an end-to-end clip model: its head's settings travel in its meta
        extra["head"] = OmegaConf.to_container(cfg.model.head)
    meta = model_meta(net, model_name=cfg.model.name, img_size=cfg.model.img_size,
                      class_names=list(module.class_names), task=cfg.task.name,
                      loader=loader, weights=weights,
                      finetune=FinetuneConfig.from_config(cfg).label,
                      **OutputConfig.from_config(cfg.model.get("output")).meta(),
                      **PersonaliseConfig.from_config(cfg.get("personalise")).meta(), **extra)
    return save_model_file(net, meta, path)


def keep_clip_model(cfg: DictConfig, module: PainLightningModule, stage: SecondStage, weights: dict, path: Path,
                    loader: dict, **extra) -> Path:
    """A two-stage fold's clip model (`ClipNet`) as a self-describing file: the frame backbone as its strategy keeps
    it (`for_keeping`, as `keep_fold_model` does: LoRA's adapters merged into a plain backbone, which an unmerged one
    is not, so it would not load), the trained temporal head, and the head's settings in its meta."""
    frame_net = module.finetune.for_keeping(module.model)  # the best checkpoint's, as second_stage loaded it
    net = clip_model(frame_net.backbone, stage.net.head)
    meta = model_meta(net, model_name=cfg.model.name, img_size=cfg.model.img_size,
                      class_names=list(module.class_names), task=cfg.task.name,
                      loader=loader, weights=weights,
                      finetune=FinetuneConfig.from_config(cfg).label,
                      **OutputConfig.from_config(cfg.model.get("output")).meta(),
                      **PersonaliseConfig.from_config(cfg.get("personalise")).meta(),
                      head=OmegaConf.to_container(cfg.model.head), **extra)
    return save_model_file(net, meta, path)
