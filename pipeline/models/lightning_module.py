"""`PainLightningModule`: the LightningModule that fine-tunes a backbone + Linear(D, n_classes) head (or an ordinal
or regression head over the task's levels, `pipeline.models.ordinal`: its own loss, its level probabilities as the
`prob_<class>` columns and the video's level called by `aggregation.ordinal_decision`).

The recipe for a small dataset: a lower learning rate for the backbone than for the fresh head, decaying further
towards the stem (layer-wise decay), linear warm-up then cosine decay applied to every group's own LR, optional
frozen-backbone warm-up epochs (a callback, not a branch in the step), and video-level validation metrics for
early stopping and checkpoint selection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import Precision
from torch import nn
from torch.nn import functional as F

from pipeline.evaluation.metrics import Evaluation, evaluate_predictions
from pipeline.models.finetune import FinetuneStrategy
from pipeline.models.ordinal import LevelHead, output_probabilities

log = logging.getLogger(__name__)
BACKBONE_PREFIX = "model.backbone."  # the backbone's keys in the module's state dict


@dataclass(frozen=True)
class OptimConfig:
    """The fine-tuning recipe. No defaults here: the values live once, in configs/model/ (and configs/data_model/)."""

    head_lr: float
    backbone_lr: float  # LR of the top backbone group
    layer_decay: float  # each group below the top gets this factor times the LR of the group above
    weight_decay: float
    warmup_epochs: float
    freeze_backbone_epochs: int


def parameter_groups(model: nn.Module, optim: OptimConfig) -> list[dict]:
    """AdamW groups: head at head_lr, backbone groups from the top down at backbone_lr * layer_decay**depth.

    Biases and normalisation weights (1-D tensors) get no weight decay. Each group carries its own "lr"; the
    scheduler multiplies each group's initial LR, so the ratios hold throughout training. Only parameters that
    require a gradient are optimised: what the fine-tuning strategy (`pipeline.models.finetune`) left trainable, at
    the LR of the group it sits in (a LoRA adapter gets its block's LR).
    """
    named_groups = model.backbone.parameter_groups()
    n = len(named_groups)
    groups = []
    for depth, (name, params) in enumerate(named_groups):
        lr = optim.backbone_lr * optim.layer_decay ** (n - 1 - depth)
        groups += _split_decay(name, [p for p in params if p.requires_grad], lr, optim.weight_decay)
    head = [p for p in model.head.parameters() if p.requires_grad]
    groups += _split_decay("head", head, optim.head_lr, optim.weight_decay)
    return [g for g in groups if g["params"]]


def _split_decay(name: str, params: Sequence[nn.Parameter], lr: float, weight_decay: float) -> list[dict]:
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    return [{"name": name, "params": decay, "lr": lr, "weight_decay": weight_decay},
            {"name": f"{name}.no_decay", "params": no_decay, "lr": lr, "weight_decay": 0.0}]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: linear warm-up from ~0 to 1, then cosine decay to 0 at total_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class PainLightningModule(pl.LightningModule):
    """Cross-entropy classifier over face crops with video-level evaluation.

    Batches are (images, labels, rows) where rows index the split's frame table (`datamodule.prediction_rows(split)`),
    so frame probabilities can be aggregated per video and per subject at the end of each evaluation epoch. A clip
    model (`ClipNet`, trained end to end) gets batches of clips (B, T, 3, H, W) whose third element is the video's
    number: one prediction row per video.
    """

    def __init__(self, model: nn.Module, class_names: Sequence[str], optim: OptimConfig, *, aggregation: str,
                 topk: int, label_smoothing: float = 0.0, class_weights: Sequence[float] | None = None,
                 channels_last: bool = False,
                 monitor: str | None = None, finetune: FinetuneStrategy | None = None) -> None:
        super().__init__()
        self.model = model
        # what trains and how the frozen part behaves (pipeline.models.finetune); prepared on `model` by its builder
        self.finetune = finetune or FinetuneStrategy()
        # a fixed backbone is rebuilt from its planned weights, never read from an epoch checkpoint (ViT-B/16: 330 MB
        # an epoch less to write); every other key still loads strictly (on_load_checkpoint)
        self.strict_loading = not self.finetune.backbone_fixed
        self.class_names = tuple(class_names)
        self.optim = optim
        self.label_smoothing = label_smoothing
        weights = None if class_weights is None else torch.tensor(list(class_weights), dtype=torch.float32)
        self.register_buffer("class_weights", weights, persistent=False)
        self.aggregation, self.topk = aggregation, topk
        self.channels_last = channels_last
        self.monitor = monitor  # the metric early stopping and checkpoint selection read: NaN there is an error
        self._outputs: dict[str, list] = {"val": [], "test": []}
        self.test_predictions: pd.DataFrame | None = None  # per-frame test predictions, set by the test epoch
        self.test_evaluation: Evaluation | None = None
        # the latest validation epoch's scores; after `trainer.validate(ckpt_path=best)` the best checkpoint's, from
        # whose videos the fold's decision threshold is chosen
        self.val_evaluation: Evaluation | None = None
        self._warned_undefined: set[str] = set()
        if self.level_head is not None and (class_weights is not None or label_smoothing):
            raise ValueError(f"trainer.class_weights and trainer.label_smoothing are settings of the cross-entropy "
                             f"loss; the {type(self.level_head).__name__} output has its own loss and takes neither "
                             f"(class_weights={class_weights}, label_smoothing={label_smoothing})")

    @property
    def level_head(self) -> LevelHead | None:
        """The network's last layer when it is an ordinal or regression head over levels; None for softmax."""
        head = getattr(self.model, "head", None)
        return head if isinstance(head, LevelHead) else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.channels_last and images.ndim == 4:  # a clip model converts its flattened frames itself
            images = images.contiguous(memory_format=torch.channels_last)
        return self.finetune.forward(self.model, images)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.finetune.backbone_fixed:
            checkpoint["state_dict"] = {key: value for key, value in checkpoint["state_dict"].items()
                                        if not key.startswith(BACKBONE_PREFIX)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        expected = {key for key in self.state_dict() if not (self.finetune.backbone_fixed
                                                             and key.startswith(BACKBONE_PREFIX))}
        missing = sorted(expected - set(checkpoint["state_dict"]))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weight(s) of the model, e.g. {missing[0]}")

    def on_train_epoch_start(self) -> None:
        self.finetune.after_train_mode(self.model)

    def train(self, mode: bool = True) -> PainLightningModule:
        """Train mode, but what the strategy keeps frozen (a frozen backbone, frozen batch norms) stays in eval mode;
        Lightning's fit keeps each submodule's mode across validation, and every training epoch starts with this."""
        super().train(mode)
        if mode:
            self.finetune.after_train_mode(self.model)
        return self

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.level_head is not None:
            return self.level_head.loss(logits.float(), labels)
        return F.cross_entropy(logits.float(), labels, weight=self.class_weights, label_smoothing=self.label_smoothing)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels, _ = batch
        logits = self(images)
        loss = self._loss(logits, labels)
        called = logits.argmax(dim=1) if self.level_head is None else self.level_head.predicted_level(logits.float())
        accuracy = (called == labels).float().mean()
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(labels))
        self.log("train/frame_accuracy", accuracy, on_step=False, on_epoch=True, batch_size=len(labels))
        return loss

    def _eval_step(self, batch, stage: str) -> None:
        images, labels, rows = batch
        logits = self(images)
        self.log(f"{stage}/loss", self._loss(logits, labels), on_step=False, on_epoch=True, batch_size=len(labels))
        self._outputs[stage].append((rows.cpu(), output_probabilities(self.model.head, logits.float()).cpu()))

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _predictions(self, stage: str) -> pd.DataFrame:
        rows = torch.cat([r for r, _ in self._outputs[stage]]).numpy()
        probs = torch.cat([p for _, p in self._outputs[stage]]).numpy()
        self._outputs[stage] = []
        frames = self.trainer.datamodule.prediction_rows(stage).loc[rows].reset_index(drop=True)
        for index, name in enumerate(self.class_names):
            frames[f"prob_{name}"] = probs[:, index]
        return frames

    def _log_metrics(self, stage: str) -> tuple[pd.DataFrame, Evaluation]:
        """Score the stage's predictions and log every metric; an undefined one (NaN) stays NaN, with a warning.

        AUROC is undefined when a split holds one class only. Logging it as 0 would look like the worst possible
        model to early stopping and checkpoint selection; so it is logged as NaN and named in a warning, and a NaN
        in the monitored metric is an error that says what to monitor instead.
        """
        predictions = self._predictions(stage)
        evaluation = evaluate_predictions(predictions, self.class_names, aggregation=self.aggregation, k=self.topk,
                                          ordinal=self.level_head is not None)
        metrics = evaluation.metrics(prefix=f"{stage}/")
        undefined = sorted(name for name, value in metrics.items() if not np.isfinite(value))
        if undefined and stage not in self._warned_undefined:
            self._warned_undefined.add(stage)
            counts = predictions.groupby("label")["sample_name"].nunique().to_dict()
            videos = {self.class_names[label]: n for label, n in counts.items()}
            log.warning("%s split: %s undefined (NaN) and logged as NaN, not 0: its videos per class are %s "
                        "(AUROC needs both classes)", stage, ", ".join(undefined), videos)
        if stage == "val" and self.monitor in undefined:
            raise ValueError(f"the monitored metric {self.monitor} is undefined (NaN) on the validation split, which "
                             f"holds videos of one class only; monitor another metric (trainer.monitor=val/loss, "
                             f"trainer.monitor_mode=min) or give the fold more validation subjects")
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name == f"{stage}/video_auroc")
        return predictions, evaluation

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self._outputs["val"] = []
            return
        _, self.val_evaluation = self._log_metrics("val")

    def on_test_epoch_end(self) -> None:
        self.test_predictions, self.test_evaluation = self._log_metrics("test")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's AMP plugin refuses to clip for any fused optimizer, for fear of scaled gradients; ours is fused
        only without a grad scaler (bf16 or fp32), so its gradients are the true ones: clip them with Lightning's
        plain (non-AMP) clipping."""
        if not optimizer.defaults.get("fused"):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        Precision.clip_gradients(self.trainer.precision_plugin, optimizer, gradient_clip_val or 0.0,
                                 gradient_clip_algorithm or "norm")

    def configure_optimizers(self):
        # The fused kernel (CPU and CUDA) updates all parameters in one pass: on a ViT-B at a small input the
        # optimizer step is otherwise about a third of the training step on a laptop CPU.
        # Not under fp16 AMP: its grad scaler would leave the gradients scaled at clipping time.
        no_scaler = getattr(self.trainer.precision_plugin, "scaler", None) is None
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        steps_per_epoch = max(1, total_steps // max(1, self.trainer.max_epochs or 1))
        optimizer, scheduler = optimizer_and_schedule(self.model, self.optim, total_steps, steps_per_epoch,
                                                      fused=no_scaler)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def optimizer_and_schedule(model: nn.Module, optim: OptimConfig, total_steps: int, steps_per_epoch: int,
                           fused: bool = True) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's parameter groups (fused where torch can and `fused`) and its per-step warm-up and
    cosine schedule: a Lightning fit's (`configure_optimizers`) and an in-memory probe's."""
    optimizer = torch.optim.AdamW(parameter_groups(model, optim), fused=fused and fused_adamw_supported(model))
    warmup_steps = int(round(optim.warmup_epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup_steps,
                                                                                        total_steps))
    return optimizer, scheduler


def fused_adamw_supported(model: nn.Module) -> bool:
    """Whether torch's fused AdamW can update every parameter of `model` (float parameters on CPU or CUDA)."""
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())
