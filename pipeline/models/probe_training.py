"""A frame probe on a fixed backbone's cached embeddings, fitted in memory: the Lightning fit's recipe without its
machinery (`model.head.fit=in_memory`).

A frozen backbone's head is one `Linear(D, n)` (or an output head over levels) on embeddings that already sit in
memory (`pipeline.data.embeddings.EmbeddingDataModule`), so an epoch is a few hundred tiny matrix products; a
Lightning fit spends most of its seconds around them (loaders, callbacks, an epoch checkpoint written and read back,
a test pass through the Trainer). Here the same recipe runs as a loop over the datamodule's own tensors:

- the training order and each crop's augmented view come from the datamodule's `EpochSampler` (seed, fold, epoch),
  batches of `loader.batch_size`, the last partial batch dropped as the loader drops it;
- the module's loss (label smoothing, class weights, an ordinal head's own loss), its parameter groups and AdamW
  (fused where torch has it), the warm-up and cosine schedule per step, gradient-norm clipping, torch's generators
  seeded per batch from (seed, fold, epoch, batch) as `SeedEachBatch` does; for a plain linear softmax head (the
  default probe) the same step written out (`head_steps`), a quarter of autograd and torch.optim's cost;
- after every epoch the validation crops are scored and aggregated per video (`trainer.aggregation`); the monitored
  metric selects the best epoch and stops the fit after `trainer.patience` epochs without a strictly better one, as
  Lightning's checkpoint and early stopping do.

What it does not do: write epoch checkpoints (a killed fold fits again from the start, in a second or two, to the
same weights) or run Lightning callbacks. The project's two callbacks that join a fit read only the epoch, its
metrics and `should_stop` (`EpochState` gives them that): a fold job's lease check runs before each epoch and a
tuning trial's pruning after it.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from pipeline.data.datamodule import EpochSampler, PainDataModule, class_balanced_weights
from pipeline.evaluation.metrics import VIDEO_KEYS, Evaluation, evaluate_predictions
from pipeline.models.fold_result import FoldResult
from pipeline.models.head_steps import LinearHeadStep
from pipeline.models.lightning_module import (
    BACKBONE_PREFIX,
    PainLightningModule,
    optimizer_and_schedule,
    warmup_cosine,
)
from pipeline.models.ordinal import output_probabilities
from pipeline.utils.cpus import one_torch_thread
from pipeline.utils.seeds import derived_seed

log = logging.getLogger(__name__)
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


@dataclass(frozen=True)
class ProbeTraining:
    """The fit's settings, the Lightning fit's own (`trainer.*`)."""

    max_epochs: int
    patience: int
    monitor: str  # a validation metric, e.g. val/video_auroc
    monitor_mode: str  # max | min
    gradient_clip_val: float | None


@dataclass
class EpochState:
    """What the project's fit callbacks read of a trainer (`StopWhenLeaseLost`, `ReportToTrial`): the epoch, its
    logged metrics, and whether to stop."""

    current_epoch: int = 0
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    should_stop: bool = False


def split_probabilities(module: PainLightningModule, datamodule: PainDataModule, role: str) -> tuple[np.ndarray,
                                                                                                      float]:
    """The split's plain embeddings through the module in evaluation batches (the evaluation loader's order): the
    class probabilities per crop and the mean loss over crops."""
    dataset = datamodule.dataset(role)
    batch = datamodule.eval_batch_size
    module.eval()
    outputs, losses = [], []
    with torch.inference_mode():
        for start in range(0, len(dataset), batch):
            labels = torch.from_numpy(dataset.labels[start:start + batch].copy())
            logits = module(dataset.plain[start:start + batch]).float()
            losses.append(float(module._loss(logits, labels)) * len(labels))
            outputs.append(output_probabilities(module.model.head, logits))
    return torch.cat(outputs).numpy(), sum(losses) / max(1, len(dataset))


def score_split(module: PainLightningModule, datamodule: PainDataModule, role: str) -> tuple[pd.DataFrame, Evaluation,
                                                                                            float]:
    """The split's per-crop predictions (`split_probabilities` on its frame rows), their evaluation and the loss."""
    probabilities, loss = split_probabilities(module, datamodule, role)
    predictions = datamodule.prediction_rows(role).loc[datamodule.dataset(role).rows].reset_index(drop=True)
    for index, name in enumerate(module.class_names):
        predictions[f"prob_{name}"] = probabilities[:, index]
    evaluation = evaluate_predictions(predictions, module.class_names, aggregation=module.aggregation,
                                      k=module.topk, decoding=module.decoding)
    return predictions, evaluation, loss


def fit_probe(module: PainLightningModule, datamodule: PainDataModule, settings: ProbeTraining,
              callbacks: Sequence = (), written_out: bool | None = None) -> FoldResult:
    """Fit the module's head on the datamodule's training embeddings; select and stop on the validation videos (the
    module docstring). On one torch thread: a head on embeddings is tiny ops."""
    if not module.finetune.on_embeddings:
        raise ValueError("model.head.fit=in_memory fits a head on cached embeddings (model.finetune=frozen with "
                         "cache.embeddings=true); this model trains its backbone")
    with one_torch_thread(), cuda_check_by_runtime():
        return _fit(module, datamodule, settings, callbacks, written_out)


@contextmanager
def cuda_check_by_runtime() -> Iterator[None]:
    """`torch.cuda.is_available` answered by the CUDA runtime's cached count while the fit runs, not by NVML.

    Importing Lightning sets `PYTORCH_NVML_BASED_CUDA_CHECK=1` (so that a check before forking data-loader workers
    does not initialise CUDA); torch then loads the NVML library anew at every check where CUDA is not initialised,
    and AdamW checks at every step: about 55 us a check on a machine without a GPU driver, as long as the rest of a
    probe's step. The fit forks no worker; the variable is put back as it was afterwards."""
    saved = os.environ.pop(NVML_CHECK, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[NVML_CHECK] = saved


def _better(score: float, best: float, mode: str) -> bool:
    return score > best if mode == "max" else score < best


@dataclass
class TrainingSplit:
    """The training embeddings, labels and batching of one fit: the training loader's, as tensors."""

    plain: torch.Tensor  # (N, D)
    views: torch.Tensor | None  # (K, N, D) augmented, or None
    labels: torch.Tensor  # (N,)
    batch: int
    batches: int  # per epoch: the last partial batch dropped where the loader drops it
    weights: np.ndarray | None  # class-balanced sampling weights, or None

    @classmethod
    def of(cls, datamodule: PainDataModule) -> TrainingSplit:
        train = datamodule.dataset("train")
        n_items, batch = len(train), datamodule.batch_size
        batches = n_items // batch if n_items > batch else 1
        weights = class_balanced_weights(train.labels) if datamodule.balanced_sampling else None
        return cls(train.plain, train.views, torch.from_numpy(train.labels.copy()), batch, batches, weights)

    @property
    def seen(self) -> int:
        """Crops per epoch."""
        return min(self.batches * self.batch, len(self.labels))


def _fit(module: PainLightningModule, datamodule: PainDataModule, settings: ProbeTraining, callbacks: Sequence,
         written_out: bool | None) -> FoldResult:
    train = TrainingSplit.of(datamodule)
    steps = training_steps(module, datamodule, train, settings.max_epochs * train.batches, settings.gradient_clip_val,
                           written_out)
    monitor = EpochMonitor(module, datamodule, settings.monitor)
    state, history = EpochState(), []
    best_epoch, best_score, best_state, waited = -1, -math.inf if settings.monitor_mode == "max" else math.inf, {}, 0
    for epoch in range(settings.max_epochs):
        state.current_epoch = epoch
        for callback in callbacks:  # a lease check: before the epoch's batches
            callback.on_train_batch_start(state, module, None, 0)
        metrics = {**_train_epoch(module, datamodule, train, epoch, steps), **monitor.scores()}
        score = metrics[settings.monitor]
        history.append({"epoch": epoch, **metrics, "lr/head": steps.lr})
        if _better(score, best_score, settings.monitor_mode):  # strictly better, as Lightning's checkpoint selects
            best_epoch, best_score, waited = epoch, float(score), 0
            best_state = {key: value.detach().clone() for key, value in module.state_dict().items()
                          if not key.startswith(BACKBONE_PREFIX)}
        else:
            waited += 1
        state.callback_metrics = {name: torch.tensor(value) for name, value in metrics.items()}
        for callback in callbacks:  # a trial's pruning: after the epoch
            callback.on_train_epoch_end(state, module)
        if waited >= settings.patience or state.should_stop:
            break
    module.load_state_dict(copy.deepcopy(best_state), strict=False)
    _, validation, _ = score_split(module, datamodule, "val")  # the best epoch's whole validation, as it scored
    log.info("probe fitted in memory: best epoch %d of %d (%s %.4f)", best_epoch, len(history), settings.monitor,
             best_score)
    return FoldResult(datamodule.fold, history=history, best_epoch=best_epoch, epochs_trained=len(history),
                      best_score=best_score, validation=validation)


def _train_epoch(module: PainLightningModule, datamodule: PainDataModule, train: TrainingSplit, epoch: int,
                 steps: TrainingSteps) -> dict[str, float]:
    """One epoch over the training embeddings in the loader's order; its mean loss and frame accuracy. The module
    holds the epoch's last weights afterwards."""
    sampler = EpochSampler(len(train.labels), datamodule.seed, stream=datamodule.fold, weights=train.weights,
                           epoch=epoch)
    order, draws = (torch.from_numpy(values) for values in sampler.draw())
    module.train()
    loss_sum, correct = steps.epoch(epoch, order, draws)
    steps.write_back()
    return {"train/loss": loss_sum / train.seen, "train/frame_accuracy": correct / train.seen}


class TrainingSteps:
    """A fit's training steps over its `TrainingSplit`: `epoch` runs one epoch's batches in the given order (a
    crop's augmented view from its draw) and gives the summed loss and the correct calls over the crops it saw (each
    loss taken before its batch's update); `lr` is the head's learning rate for the next step; `write_back` leaves
    the current weights in the module."""

    def __init__(self, module: PainLightningModule, datamodule: PainDataModule, train: TrainingSplit,
                 total_steps: int, clip: float | None) -> None:
        self.module, self.datamodule, self.train, self.clip = module, datamodule, train, clip

    @property
    def lr(self) -> float:
        raise NotImplementedError

    def epoch(self, epoch: int, order: torch.Tensor, draws: torch.Tensor) -> tuple[float, float]:
        raise NotImplementedError

    def write_back(self) -> None:
        """Nothing to do where the steps update the module's own parameters."""

    def batches(self, order: torch.Tensor, draws: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The epoch's batches: their number, the crops chosen (positions in the split) and the embeddings they are
        read as (each crop's augmented view from its draw, else the plain one)."""
        train, size = self.train, self.train.batch
        for index in range(train.batches):
            chosen = order[index * size:(index + 1) * size]
            yield index, chosen, (train.views[draws[index * size:(index + 1) * size] % len(train.views), chosen]
                                  if train.views is not None else train.plain[chosen])


class TorchSteps(TrainingSteps):
    """Through the module: its loss by autograd, `clip_grad_norm_`, torch's AdamW over its parameter groups and the
    per-step schedule (`optimizer_and_schedule`), as the Lightning fit steps. Any head the in-memory fit takes."""

    def __init__(self, module: PainLightningModule, datamodule: PainDataModule, train: TrainingSplit,
                 total_steps: int, clip: float | None) -> None:
        super().__init__(module, datamodule, train, total_steps, clip)
        self.optimizer, self.scheduler = optimizer_and_schedule(module.model, module.optim, total_steps,
                                                                train.batches)
        self.parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.stochastic = draws_randomness(module)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[-1]["lr"]

    def epoch(self, epoch: int, order: torch.Tensor, draws: torch.Tensor) -> tuple[float, float]:
        module, datamodule = self.module, self.datamodule
        loss_sum, correct = torch.zeros(()), torch.zeros(())
        for index, chosen, embeddings in self.batches(order, draws):
            if self.stochastic:  # as SeedEachBatch seeds torch's generators (the head is on the CPU: its generator)
                torch.default_generator.manual_seed(derived_seed(datamodule.seed, datamodule.fold, epoch, index))
            labels = self.train.labels[chosen]
            logits = module(embeddings)
            loss = module._loss(logits, labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.parameters, self.clip)
            self.optimizer.step()
            self.scheduler.step()
            with torch.no_grad():
                loss_sum += loss * len(chosen)
                called = (logits.argmax(dim=1) if module.level_head is None
                          else module.level_head.predicted_level(logits.float()))
                correct += (called == labels).sum()
        return float(loss_sum), float(correct)


class WrittenOutSteps(TrainingSteps):
    """A plain linear softmax head's steps written out (`head_steps.LinearHeadStep`): the same arithmetic as
    `TorchSteps` at under a fifth of its cost a step, for the heads `fits` accepts. The epoch's losses and calls are
    counted once, from its batches' logits, after the epoch."""

    def __init__(self, module: PainLightningModule, datamodule: PainDataModule, train: TrainingSplit,
                 total_steps: int, clip: float | None) -> None:
        super().__init__(module, datamodule, train, total_steps, clip)
        head = module.model.head
        self.step = LinearHeadStep(head.weight, head.bias, module.optim.weight_decay, clip)
        self.targets = LinearHeadStep.targets(train.labels, head.out_features, module.label_smoothing)
        # the embeddings with the bias' column of ones: the augmented views gain theirs a batch at a time
        self.inputs = LinearHeadStep.with_ones(train.plain) if train.views is None else None
        self.head_lr, self.total_steps = module.optim.head_lr, total_steps
        self.warmup_steps = int(round(module.optim.warmup_epochs * train.batches))  # as optimizer_and_schedule's

    @staticmethod
    def fits(module: PainLightningModule) -> bool:
        """A `Linear` head with a bias trained alone by the plain cross-entropy (label smoothing allowed): no
        output head over levels, class weights or dropout, nothing else trainable."""
        head = module.model.head
        trainable = [p for p in module.model.parameters() if p.requires_grad]
        return (isinstance(head, nn.Linear) and head.bias is not None and module.level_head is None
                and module.class_weights is None and not draws_randomness(module)
                and {id(p) for p in trainable} == {id(head.weight), id(head.bias)})

    @property
    def lr(self) -> float:
        return self.head_lr * warmup_cosine(self.step.steps, self.warmup_steps, self.total_steps)

    def epoch(self, epoch: int, order: torch.Tensor, draws: torch.Tensor) -> tuple[float, float]:
        seen, outputs = [], []
        if self.inputs is not None:
            size = self.train.batch
            for index in range(self.train.batches):
                chosen = order[index * size:(index + 1) * size]
                # index_select: a third of advanced indexing's cost for a batch of rows
                outputs.append(self.step(self.inputs.index_select(0, chosen), self.targets.index_select(0, chosen),
                                         self.lr))
                seen.append(chosen)
        else:
            for _, chosen, embeddings in self.batches(order, draws):
                outputs.append(self.step(LinearHeadStep.with_ones(embeddings), self.targets[chosen], self.lr))
                seen.append(chosen)
        chosen, logits = torch.cat(seen), torch.cat(outputs)
        losses = -(self.targets[chosen] * torch.log_softmax(logits, dim=1)).sum()
        return float(losses), float((logits.argmax(dim=1) == self.train.labels[chosen]).sum())

    def write_back(self) -> None:
        self.step.write_back()


def training_steps(module: PainLightningModule, datamodule: PainDataModule, train: TrainingSplit, total_steps: int,
                   clip: float | None, written_out: bool | None = None) -> TrainingSteps:
    """The fit's steps: written out where the head allows (`WrittenOutSteps.fits`), else through torch; `written_out`
    chooses (a test compares the two)."""
    if written_out is None:
        written_out = WrittenOutSteps.fits(module)
    if written_out and not WrittenOutSteps.fits(module):
        raise ValueError("the written-out steps fit a plain linear softmax head alone")
    return (WrittenOutSteps if written_out else TorchSteps)(module, datamodule, train, total_steps, clip)


def draws_randomness(module: nn.Module) -> bool:
    """Whether a training step of `module` draws random numbers (a dropout layer in training mode): a linear probe
    on embeddings draws none, so seeding each batch would change nothing."""
    return any(isinstance(layer, nn.modules.dropout._DropoutNd) and layer.training and layer.p > 0
               for layer in module.modules())


class EpochMonitor:
    """The validation losses and the monitored metric after each epoch: `val/loss` over the validation crops and,
    for the default monitor (`val/video_auroc` of a two-class softmax head, its crops' probabilities averaged per
    video), that AUROC from the videos' mean probability; any other monitor from the whole evaluation."""

    def __init__(self, module: PainLightningModule, datamodule: PainDataModule, monitor: str) -> None:
        self.module, self.datamodule, self.monitor = module, datamodule, monitor
        rows = datamodule.prediction_rows("val").loc[datamodule.dataset("val").rows]
        self.videos, names = pd.factorize(pd.MultiIndex.from_frame(rows[VIDEO_KEYS]))
        self.counts = np.bincount(self.videos, minlength=len(names))
        self.video_labels = rows.groupby(self.videos)["label"].first().to_numpy()
        self.fast = (monitor in ("val/loss", "val/video_auroc") and module.aggregation == "mean"
                     and module.level_head is None and len(module.class_names) == 2)

    def scores(self) -> dict[str, float]:
        if not self.fast:
            _, evaluation, loss = score_split(self.module, self.datamodule, "val")
            scores = {"val/loss": loss, **evaluation.metrics(prefix="val/")}
        else:
            probabilities, loss = split_probabilities(self.module, self.datamodule, "val")
            scores = {"val/loss": loss}
            if self.monitor == "val/video_auroc":
                means = np.bincount(self.videos, weights=probabilities[:, 1].astype(float)) / self.counts
                both = len(np.unique(self.video_labels)) == 2
                scores[self.monitor] = float(roc_auc_score(self.video_labels, means)) if both else math.nan
        if not np.isfinite(scores.get(self.monitor, math.nan)):
            raise ValueError(f"the monitored metric {self.monitor} is undefined (NaN) on the validation split; "
                             f"monitor another metric (trainer.monitor=val/loss, trainer.monitor_mode=min) or give "
                             f"the fold more validation subjects")
        return scores


def score_test(module: PainLightningModule, datamodule: PainDataModule) -> tuple[pd.DataFrame, Evaluation]:
    """The fitted probe scored once on the test subjects: per-crop predictions and their evaluation."""
    predictions, evaluation, _ = score_split(module, datamodule, "test")
    return predictions, evaluation
