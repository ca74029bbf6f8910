"""Training policies as Lightning callbacks, not branches in the training step: a frozen-backbone warm-up, keyed
random draws for every batch, and early stopping whose decision survives a resume."""

from __future__ import annotations

import logging

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason

from pipeline.models.lightning_module import PainLightningModule
from pipeline.utils.seeds import derived_seed

log = logging.getLogger(__name__)


class FreezeBackbone(pl.Callback):
    """Train only the head for the first `epochs` epochs, then what the fine-tuning strategy trains (a policy).

    The backbone parameters that train after the warm-up are those that required a gradient when fit started: the
    strategy's choice (`pipeline.models.finetune`), all of them for `full`.
    """

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs
        self._trainable: set[int] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: PainLightningModule) -> None:
        self._trainable = {id(p) for p in pl_module.model.backbone.parameters() if p.requires_grad}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: PainLightningModule) -> None:
        frozen = trainer.current_epoch < self.epochs
        if self._trainable is None:
            self.on_fit_start(trainer, pl_module)
        assert self._trainable is not None
        for parameter in pl_module.model.backbone.parameters():
            parameter.requires_grad_(not frozen and id(parameter) in self._trainable)
        if trainer.current_epoch in (0, self.epochs) and self.epochs > 0:
            log.info("epoch %d: backbone %s", trainer.current_epoch, "frozen" if frozen else "unfrozen")


class SeedEachBatch(pl.Callback):
    """Seed torch's generators (CPU and every GPU) before each training batch from (seed, fold, epoch, batch).

    Dropout, stochastic depth and any other draw inside the model then depend on where training is, not on what ran
    before in this process: a fold resumed from an epoch checkpoint draws what an uninterrupted one draws, although
    the resumed process has not built the same loaders, nor spent the same random numbers on them.
    """

    def __init__(self, seed: int, fold: int) -> None:
        self.seed, self.fold = int(seed), int(fold)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if batch_idx == 0:
            drawn = getattr(trainer.train_dataloader.sampler, "drawn_epoch", None)
            if drawn is not None and drawn != trainer.current_epoch:
                raise RuntimeError(f"epoch {trainer.current_epoch} is training on the crop order of epoch {drawn}: the "
                                   f"loader was iterated before its sampler learnt the epoch; the run would not "
                                   f"repeat")
        torch.manual_seed(derived_seed(self.seed, self.fold, trainer.current_epoch, batch_idx))


class ResumableEarlyStopping(EarlyStopping):
    """Early stopping whose decision survives a resume.

    Lightning restores the counter and the reason from a checkpoint but not the trainer's `should_stop`: a fold
    killed after the checkpoint of the epoch that decided to stop would otherwise train on when resumed, and keep a
    different best epoch than the uninterrupted run.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
            trainer.should_stop = True


class KeepBestValidation(pl.Callback):
    """Keeps the validation evaluation of the epoch the best checkpoint comes from, as it is computed, so the fold's
    threshold is chosen on it without a second validation pass over the best checkpoint.

    "Best" is decided as Lightning's ModelCheckpoint decides it (strictly better on `monitor` in `mode`). Only this
    process's epochs are seen: a fold resumed after its best epoch has `epoch` -1 or another epoch, and the caller
    validates the best checkpoint again instead (`pipeline.runs.jobs.fold_fit.validate_best`).
    """

    def __init__(self, monitor: str, mode: str = "max") -> None:
        self.monitor, self.mode = monitor, mode
        self.best: float | None = None
        self.epoch = -1
        self.evaluation: object | None = None  # pipeline.evaluation.metrics.Evaluation

    def on_validation_end(self, trainer: pl.Trainer, pl_module: PainLightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        if score != score:  # NaN never becomes the best
            return
        if self.best is None or (score > self.best if self.mode == "max" else score < self.best):
            self.best, self.epoch, self.evaluation = score, trainer.current_epoch, pl_module.val_evaluation
