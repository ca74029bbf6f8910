"""A fold's fit: Lightning on the fold's training subjects with early stopping on its validation subjects, an epoch
checkpoint every epoch (written atomically; a fold that finds one resumes from it exactly), the best epoch's
checkpoint selected (`lightning_fit`), then validated again where needed and tested once (`fit_fold`).

`fit_fold` is how a head mode fits a network with Lightning (`pipeline.runs.jobs.head_modes.HeadMode.fit`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import mlflow
import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.plugins.io import TorchCheckpointIO

from pipeline.data.datamodule import PainDataModule
from pipeline.evaluation.metrics import Evaluation
from pipeline.models.callbacks import FreezeBackbone, KeepBestValidation, ResumableEarlyStopping, SeedEachBatch
from pipeline.models.fold_result import FoldResult
from pipeline.models.lightning_module import PainLightningModule
from pipeline.runs.jobs.step_times import StepTimes
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.store.tracking import RESUMED_AFTER_EPOCH_TAG
from pipeline.utils.atomic_io import atomic_path
from pipeline.utils.cpus import one_torch_thread

log = logging.getLogger(__name__)


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


class AtomicCheckpointIO(TorchCheckpointIO):
    """Epoch checkpoints written beside their target and renamed onto it: a job killed mid-write leaves the last
    complete checkpoint, never a truncated one."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)


def fit_fold(training: TrainingSettings, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
             precision: str, extra_callbacks: Sequence[pl.Callback], scored: Sequence[str],
             times: StepTimes) -> FoldResult:
    """The fold's fit (`lightning_fit`), then its best checkpoint scored on the splits in `scored`: re-validated
    (`val`: the predictions the threshold is chosen on) and tested once (`test`)."""
    with times("fit"):
        trainer, result, kept = lightning_fit(training, module, datamodule, work_dir, precision, extra_callbacks)
    if "val" in scored:
        with times("validation_repass"):
            result.validation = kept if kept is not None else validate_best(trainer, result, module, datamodule)
    if "test" in scored:
        with times("test"):
            with one_torch_thread(module.finetune.on_embeddings):
                trainer.test(module, datamodule=datamodule, ckpt_path=result.best_path, verbose=False)
            result.frame_predictions, result.evaluation = module.test_predictions, module.test_evaluation
    return result


def lightning_fit(training: TrainingSettings, module: PainLightningModule, datamodule: PainDataModule, work_dir: Path,
                  precision: str, extra_callbacks: Sequence[pl.Callback] = ()
                  ) -> tuple[pl.Trainer, FoldResult, Evaluation | None]:
    """Train with early stopping; select the best epoch on the inner validation subjects. Returns the trainer, the
    fold's result so far (its epochs, the best checkpoint, what was selected) and the best epoch's validation as it
    ran (None where the best epoch did not run in this process).

    Every epoch writes `last.ckpt` into work_dir; a fold that finds one there continues from it, exactly: the
    checkpoint holds the weights, optimizer, LR schedule, early-stopping counter, best-checkpoint record and epoch
    history, and every random draw of the remaining epochs is keyed by (seed, fold, epoch[, batch])
    (`EpochSampler`, `SeedEachBatch`), so it does not depend on the epochs before having run in this process.
    `extra_callbacks` join the fit (a tuning trial's pruning callback, `pipeline.runs.orchestration.search_workers`).
    """
    trainer_settings = training.trainer
    if trainer_settings.devices != 1:
        raise ValueError("trainer.devices must be 1: video-level metrics are computed from one process's predictions")
    epoch_logger = MlflowEpochLogger()
    best = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="best", monitor=trainer_settings.monitor,
                                        mode=trainer_settings.monitor_mode, save_top_k=1, save_weights_only=True)
    # every epoch's full state, overwritten in place (Lightning's save_last only writes when another save happened)
    last = pl.callbacks.ModelCheckpoint(dirpath=work_dir, filename="last", monitor=None, save_top_k=1,
                                        enable_version_counter=False)
    early_stopping = ResumableEarlyStopping(monitor=trainer_settings.monitor, mode=trainer_settings.monitor_mode,
                                           patience=trainer_settings.patience)
    keeper = KeepBestValidation(trainer_settings.monitor, trainer_settings.monitor_mode)
    callbacks = [epoch_logger, best, last, early_stopping, SeedEachBatch(training.seed, datamodule.fold), keeper,
                 *extra_callbacks]
    if training.optim.freeze_backbone_epochs > 0:
        callbacks.append(FreezeBackbone(training.optim.freeze_backbone_epochs))
    plugins = [AtomicCheckpointIO()]
    if "SLURM_JOB_ID" in os.environ:  # submitit owns requeueing on SLURM; Lightning's own would requeue twice
        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(LeaveSigtermToSubmitit())
    limits = trainer_settings.limits
    trainer = pl.Trainer(
        max_epochs=trainer_settings.max_epochs, accelerator=trainer_settings.accelerator,
        devices=trainer_settings.devices, precision=precision,
        gradient_clip_val=trainer_settings.gradient_clip_val, deterministic=trainer_settings.deterministic,
        log_every_n_steps=trainer_settings.log_every_n_steps, callbacks=callbacks, logger=False, plugins=plugins,
        default_root_dir=work_dir, enable_model_summary=False, num_sanity_val_steps=0,
        enable_progress_bar=sys.stderr.isatty(), **limits)  # a bar in a terminal, none in a job's log file
    resume_from = work_dir / "last.ckpt"
    if resume_from.is_file():
        log.warning("fold: continuing from the epoch checkpoint %s", resume_from)
    with one_torch_thread(module.finetune.on_embeddings):
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from.is_file() else None)
    if not best.best_model_path:
        raise RuntimeError(f"no checkpoint was selected on {trainer_settings.monitor} (was it logged?); "
                           f"refusing to test the last epoch's weights instead")
    best_score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    best_epoch = next((h["epoch"] for h in epoch_logger.history
                       if np.isclose(h.get(trainer_settings.monitor, np.nan), best_score)), -1)
    kept = keeper.evaluation if keeper.epoch == best_epoch >= 0 else None
    result = FoldResult(datamodule.fold, history=epoch_logger.history, best_path=best.best_model_path,
                        best_epoch=best_epoch, epochs_trained=len(epoch_logger.history), best_score=best_score)
    return trainer, result, kept


def validate_best(trainer: pl.Trainer, result: FoldResult, module: PainLightningModule,
                  datamodule: PainDataModule) -> Evaluation:
    """The best checkpoint's scores on the fold's validation subjects (the last epoch's may be another epoch's), for a
    fold resumed after its best epoch: validated again."""
    with one_torch_thread(module.finetune.on_embeddings):
        trainer.validate(module, datamodule=datamodule, ckpt_path=result.best_path, verbose=False)
    return module.val_evaluation
