"""The second stage of two-stage clip training: a temporal head trained on a fixed frame model's embeddings.

The frame model of a fold (fine-tuned on the fold's training subjects, or a frozen pretrained backbone) has embedded
the fold's crops once (`pipeline.models.embedding_cache`); here each video becomes one clip of T embeddings in time
order (`pipeline.data.clips.clip_rows`) and the head trains on the training clips, with early stopping on the
validation clips, in a plain loop: the clips fit in memory and an epoch takes milliseconds, so no Lightning machinery
is needed. The order of every epoch is keyed on (seed, fold, epoch) as image training is, so a rerun (a fold resumed
after it was killed in this stage) trains the same head.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.data.clips import clip_rows, prediction_table
from pipeline.data.embeddings import EmbeddingTable
from pipeline.evaluation.metrics import classification_metrics
from pipeline.models.ordinal import LevelHead, output_probabilities
from pipeline.utils.cpus import one_torch_thread
from pipeline.utils.seeds import derived_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Clips:
    """A split's videos as clips of embeddings: `videos` (one row per video, `rows` its crops), `embeddings`
    (V, T, D) and `labels` (V,)."""

    videos: pd.DataFrame
    embeddings: torch.Tensor
    labels: torch.Tensor


def embedded_clips(frames: pd.DataFrame, table: EmbeddingTable, clip_frames: int, source: Path) -> Clips:
    """The clips of `frames`' videos, each the embeddings of its `clip_frames` crops in time order."""
    videos = clip_rows(frames, clip_frames)
    rows = np.stack(videos["rows"].to_numpy())  # (V, T)
    positions = table.positions(rows.reshape(-1), source).reshape(rows.shape)
    embeddings = torch.from_numpy(np.ascontiguousarray(table.plain[positions]))
    return Clips(videos, embeddings, torch.tensor(videos["label"].to_numpy(dtype=np.int64)))


@dataclass(frozen=True)
class HeadTraining:
    """How the head trains: epochs at most, patience (epochs without a better validation score), AdamW's settings."""

    max_epochs: int
    patience: int
    lr: float
    weight_decay: float
    batch_size: int
    seed: int
    stream: int  # the fold: each fold's epochs are drawn apart


@dataclass
class TrainedHead:
    head: nn.Module  # the best epoch's weights
    best_epoch: int
    best_score: float  # validation video AUROC (binary) or minus the validation loss
    history: list[dict] = field(default_factory=list)


def clip_probabilities(head: nn.Module, embeddings: torch.Tensor) -> np.ndarray:
    was_training = head.training
    head.eval()
    with torch.inference_mode():
        probabilities = output_probabilities(head, head(embeddings).float()).numpy()  # softmax, or levels
    head.train(was_training)
    return probabilities


def validation_score(head: nn.Module, clips: Clips) -> tuple[float, float]:
    """(score, loss) on the validation clips: the score is the video AUROC for two classes (the frame model's
    monitor), minus the loss otherwise or where AUROC is undefined."""
    probabilities = clip_probabilities(head, clips.embeddings)
    labels = clips.labels.numpy()
    loss = float(F.nll_loss(torch.log(torch.from_numpy(probabilities).clamp_min(1e-12)), clips.labels))
    if probabilities.shape[1] == 2 and len(np.unique(labels)) == 2:
        auroc = classification_metrics(labels, probabilities).get("auroc", np.nan)
        if np.isfinite(auroc):
            return float(auroc), loss
    return -loss, loss


def head_loss(head: nn.Module, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a softmax head's logits; an ordinal or regression head's own loss over the levels."""
    return head.loss(outputs, labels) if isinstance(head, LevelHead) else F.cross_entropy(outputs, labels)


def train_head(head: nn.Module, train: Clips, val: Clips, settings: HeadTraining) -> TrainedHead:
    """Train `head` on the training clips; keep the epoch with the best validation score; stop after `patience`
    epochs without a better one. On one torch thread: a head on embeddings is tiny ops (`one_torch_thread`)."""
    with one_torch_thread():
        return _train_head(head, train, val, settings)


def _train_head(head: nn.Module, train: Clips, val: Clips, settings: HeadTraining) -> TrainedHead:
    torch.manual_seed(derived_seed(settings.seed, settings.stream, 1 << 30))  # the same dropout draws on a rerun
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    best = TrainedHead(copy.deepcopy(head), -1, -np.inf)
    for epoch in range(settings.max_epochs):
        rng = np.random.default_rng(derived_seed(settings.seed, settings.stream, epoch))
        order = torch.from_numpy(rng.permutation(len(train.labels)))
        head.train()
        losses = []
        for start in range(0, len(order), settings.batch_size):
            batch = order[start:start + settings.batch_size]
            loss = head_loss(head, head(train.embeddings[batch]).float(), train.labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        score, val_loss = validation_score(head, val)
        best.history.append({"epoch": epoch, "head/train_loss": float(np.mean(losses)), "head/val_loss": val_loss,
                             "head/val_score": score})
        if score > best.best_score:
            best.head, best.best_epoch, best.best_score = copy.deepcopy(head), epoch, score
        elif epoch - best.best_epoch >= settings.patience:
            break
    log.info("temporal head: best epoch %d of %d (validation score %.4f)", best.best_epoch, len(best.history),
             best.best_score)
    return best


def clip_predictions(head: nn.Module, clips: Clips, class_names: tuple[str, ...]) -> pd.DataFrame:
    """One row per video (its clip's probabilities as `prob_<class>`), in the frame-prediction layout the
    evaluation reads: a video's score is its clip's."""
    probabilities = clip_probabilities(head, clips.embeddings)
    table = prediction_table(clips.videos)
    for index, name in enumerate(class_names):
        table[f"prob_{name}"] = probabilities[:, index]
    return table
