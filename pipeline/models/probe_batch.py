"""Many frozen probes fitted at once: the in-memory probe's recipe (`pipeline.models.probe_training`) run in lockstep
over M linear heads whose crops, seeds and folds differ, for simulations that fit thousands of cross-validations
(`make power`'s resampled studies, pipeline/analysis/resampled_power.py).

Each probe is what `fit_probe` fits on one fold of a frozen backbone's embeddings, step for step:

- its epoch order from `EpochSampler` (its seed, its fold as the stream, the epoch), batches of `batch_size` with the
  last partial batch dropped (the whole set as one batch where it is no larger);
- the cross-entropy loss, gradient-norm clipping of its own head, and AdamW (torch's update: decoupled weight decay on
  the weight, none on the bias; bias corrections from its own step count) at the head's learning rate times the
  warm-up and cosine schedule of its own steps;
- after every epoch its validation crops scored, averaged per video (mean aggregation), and the video AUROC selecting
  the best epoch, strictly better only, stopping after `patience` epochs without one.

Lockstep costs nothing in faithfulness: the heads share no parameter, so each head's gradient is its own batch's
(written out: a linear head's mean cross-entropy has the gradient (softmax - one-hot) / batch times the batch's
embeddings), and every update is elementwise. A probe whose epoch has fewer batches sits out the rest of it; one that
stopped sits out the rest of the fit. `tests/test_probe_batch.py` checks the weights and scores against
`fit_probe` itself. What it does not do is what the recipe's defaults leave out: augmented views, class weights,
label smoothing, class-balanced sampling, another monitor or aggregation (`check_recipe` refuses them).

A probe may read its embeddings shifted (`ProbeSpec.shift`): the embedding plus `shift` times a fixed matrix of one
row per crop (`Embeddings.shift`): a noise draw (a worse backbone) or the crop's own action units projected into the
embedding space (a better one), a configuration of known degree for a power curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata

from pipeline.data.datamodule import EpochSampler
from pipeline.models.head_steps import adamw_update, clip_coefficient
from pipeline.models.lightning_module import warmup_cosine
from pipeline.utils.cpus import one_torch_thread


@dataclass(frozen=True)
class BatchRecipe:
    """The fit's settings: the in-memory probe's (`trainer.*`, `model.optim.*`, `loader.batch_size`)."""

    batch_size: int
    max_epochs: int
    patience: int
    head_lr: float
    weight_decay: float
    warmup_epochs: float
    gradient_clip_val: float | None


@dataclass(frozen=True)
class Embeddings:
    """The crops' embeddings every probe reads by position: `plain` (N, D); `shift` (N, D), a fixed matrix a probe
    adds at its own scale (float16 is enough), or None."""

    plain: torch.Tensor
    shift: torch.Tensor | None = None

    def rows(self, positions: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Embeddings at `positions` (M, B) for M probes, each shifted at its `scale` (M,): (M, B, D). Probes of one
        seed and fold read the same crops (the copies of a power curve): each distinct row of crops is gathered
        once."""
        unique, inverse = torch.unique(positions, dim=0, return_inverse=True)
        x = self.plain[unique][inverse]
        shifted = torch.nonzero(scale).flatten()
        if self.shift is not None and len(shifted):
            needed, which = torch.unique(inverse[shifted], return_inverse=True)
            x[shifted] += scale[shifted, None, None] * self.shift[unique[needed]].float()[which]
        return x


@dataclass(frozen=True)
class ProbeSpec:
    """One probe: its training crops (positions into `Embeddings`, with labels), its validation crops with the video
    each belongs to and the videos' labels, its seed and fold (the keys of its training order), its initial head
    (weight (C, D), bias (C,)) and the scale of the shift it reads its embeddings with."""

    train: np.ndarray
    train_labels: np.ndarray
    val: np.ndarray
    val_videos: np.ndarray  # per validation crop: its video's number, 0..V-1
    val_video_labels: np.ndarray  # (V,)
    seed: int
    fold: int
    weight: torch.Tensor
    bias: torch.Tensor
    shift: float = 0.0


@dataclass
class BatchFit:
    """The best epoch's heads (weight (M, C, D), bias (M, C)), each probe's best epoch, its score there and the epochs
    it trained."""

    weight: torch.Tensor
    bias: torch.Tensor
    best_epoch: np.ndarray
    best_score: np.ndarray
    epochs: np.ndarray


def binary_auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUROC of binary labels from the ranks of the scores, ties shared (what sklearn's roc_auc_score gives); NaN with
    one class only."""
    positives = labels == 1
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if not n_pos or not n_neg:
        return math.nan
    ranks = rankdata(scores)
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def video_auroc(spec: ProbeSpec, probabilities: np.ndarray) -> float:
    """The validation video AUROC of one probe from its crops' probability of class 1, averaged per video."""
    counts = np.bincount(spec.val_videos, minlength=len(spec.val_video_labels))
    means = np.bincount(spec.val_videos, weights=probabilities.astype(float),
                        minlength=len(spec.val_video_labels)) / counts
    return binary_auroc(spec.val_video_labels, means)


class LockstepAdamW:
    """AdamW over M linear heads, each with its own step count and learning rate: torch.optim.AdamW's update
    (`head_steps.adamw_update`), elementwise, for the heads that step. Each head's weight and bias sit side by side
    in one row of `state` (the bias as the last column), with their two moments beside them, so a step reads and
    writes each head once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, weight_decay: float) -> None:
        m, classes, features = weight.shape
        self.state = torch.zeros(m, 3, classes, features + 1)  # per head: parameters, first and second moments
        self.state[:, 0, :, :features], self.state[:, 0, :, features] = weight, bias
        # decoupled weight decay on the weight only: the bias is a 1-D parameter (parameter_groups)
        self.decay = torch.cat([torch.full((features,), float(weight_decay)), torch.zeros(1)])
        self.steps = torch.zeros(m, dtype=torch.float64)

    @property
    def weight(self) -> torch.Tensor:
        return self.state[:, 0, :, :-1]

    @property
    def bias(self) -> torch.Tensor:
        return self.state[:, 0, :, -1]

    @torch.no_grad()
    def step(self, members: torch.Tensor, lr: torch.Tensor, grad: torch.Tensor) -> None:
        """One update of the heads `members` with their learning rates `lr` (float64, (k,)) and gradients (k, C,
        D + 1: the weight's, the bias' as the last column)."""
        self.steps[members] += 1
        state = self.state.index_select(0, members)
        param, first, second = state.unbind(1)
        adamw_update(param, first, second, grad, lr.float().view(-1, 1, 1), self.steps[members], self.decay)
        self.state.index_copy_(0, members, state)


def check_recipe(monitor: str, aggregation: str, views: int, balanced_sampling: bool, label_smoothing: float,
                 class_weights: object) -> None:
    """The settings the lockstep fit reproduces: the in-memory probe's defaults; anything else is refused, naming
    it (fit such probes one by one with `probe_training.fit_probe`)."""
    problems = [f"{name}={value!r}" for name, value, default in (
        ("trainer.monitor", monitor, "val/video_auroc"), ("trainer.aggregation", aggregation, "mean"),
        ("cache.views", views, 0), ("loader.balanced_sampling", balanced_sampling, False),
        ("trainer.label_smoothing", label_smoothing, 0.0), ("trainer.class_weights", class_weights, None))
        if value != default]
    if problems:
        raise ValueError(f"the lockstep probes fit the in-memory probe's default recipe; not {', '.join(problems)}")


def fit_probes(embeddings: Embeddings, specs: Sequence[ProbeSpec], recipe: BatchRecipe) -> BatchFit:
    """Fit every probe of `specs` on `embeddings` by the in-memory probe's recipe (module docstring), on one torch
    thread; the best epoch's heads and their selection."""
    with one_torch_thread(), torch.no_grad():
        return _fit(embeddings, list(specs), recipe)


@dataclass
class Selection:
    """Each probe's best epoch so far: its heads, epoch and score, the epochs it waited since and trained, and whether
    it still trains."""

    weight: torch.Tensor
    bias: torch.Tensor
    epoch: np.ndarray
    score: np.ndarray
    waited: np.ndarray
    epochs: np.ndarray
    active: np.ndarray

    @classmethod
    def start(cls, weight: torch.Tensor, bias: torch.Tensor) -> Selection:
        m = len(weight)
        return cls(weight.detach().clone(), bias.detach().clone(), np.full(m, -1), np.full(m, -math.inf),
                   np.zeros(m, dtype=int), np.zeros(m, dtype=int), np.ones(m, dtype=bool))

    def update(self, i: int, epoch: int, score: float, weight: torch.Tensor, bias: torch.Tensor,
               patience: int) -> None:
        """Probe i's epoch scored `score`: kept where strictly better (as Lightning's checkpoint and the in-memory
        probe select), stopped after `patience` epochs without."""
        self.epochs[i] += 1
        if score > self.score[i]:
            self.epoch[i], self.score[i], self.waited[i] = epoch, score, 0
            self.weight[i], self.bias[i] = weight, bias
        else:
            self.waited[i] += 1
        self.active[i] = self.waited[i] < patience


def _fit(embeddings: Embeddings, specs: list[ProbeSpec], recipe: BatchRecipe) -> BatchFit:
    optimizer = LockstepAdamW(torch.stack([s.weight.detach().float() for s in specs]),
                              torch.stack([s.bias.detach().float() for s in specs]), recipe.weight_decay)
    weight, bias = optimizer.weight, optimizer.bias
    sizes = np.array([len(s.train) for s in specs])
    batches = np.where(sizes > recipe.batch_size, sizes // recipe.batch_size, 1)
    shift = torch.tensor([s.shift for s in specs], dtype=torch.float32)
    selection = Selection.start(weight, bias)
    for epoch in range(recipe.max_epochs):
        members = np.flatnonzero(selection.active)
        if not len(members):
            break
        positions, labels, mask = _epoch_batches(specs, members, epoch, sizes, batches, recipe.batch_size)
        for step in range(int(batches[members].max())):
            rows = np.flatnonzero(batches[members] > step)
            columns = slice(step * recipe.batch_size, (step + 1) * recipe.batch_size)
            _train_step(embeddings, members[rows], positions[rows, columns], labels[rows, columns],
                        mask[rows, columns], recipe, weight, bias, optimizer, shift, batches)
        for i in members:
            score = _validate(embeddings, specs[i], weight[i].detach(), bias[i].detach(), float(shift[i]))
            if not np.isfinite(score):
                raise ValueError(f"probe {i} (seed {specs[i].seed}, fold {specs[i].fold}): the validation video "
                                 f"AUROC is undefined (one class only among its validation videos)")
            selection.update(int(i), epoch, score, weight[i].detach(), bias[i].detach(), recipe.patience)
    return BatchFit(selection.weight, selection.bias, selection.epoch, selection.score, selection.epochs)


def _epoch_batches(specs: list[ProbeSpec], members: np.ndarray, epoch: int, sizes: np.ndarray, batches: np.ndarray,
                   size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One epoch's training crops of every probe in `members`, in its `EpochSampler` order, row by row (positions,
    labels, and a mask of the crops it trains on: its batches' worth, the last partial batch dropped)."""
    width = int(max(batches[members].max() * size, sizes[members][batches[members] == 1].max(initial=0)))
    positions = np.zeros((len(members), width), dtype=np.int64)
    labels = np.zeros((len(members), width), dtype=np.int64)
    mask = np.zeros((len(members), width), dtype=np.float32)
    for row, i in enumerate(members):
        order = EpochSampler(int(sizes[i]), specs[i].seed, stream=specs[i].fold, epoch=epoch).draw()[0]
        taken = order[:batches[i] * size]
        positions[row, :len(taken)] = specs[i].train[taken]
        labels[row, :len(taken)] = specs[i].train_labels[taken]
        mask[row, :len(taken)] = 1.0
    return positions, labels, mask


def _train_step(embeddings: Embeddings, stepping: np.ndarray, positions: np.ndarray, labels: np.ndarray,
                mask: np.ndarray, recipe: BatchRecipe, weight: torch.Tensor, bias: torch.Tensor,
                optimizer: LockstepAdamW, shift: torch.Tensor, batches: np.ndarray) -> None:
    """One batch of every probe in `stepping`: the gradient of its mean cross-entropy (written out: a linear head's
    is (softmax - one-hot) / batch, times the batch's embeddings), clipped per head, and its AdamW update.

    Probes that read the same crops (the copies of one seed and fold) form a group: the group's crops are gathered
    once, with a column of ones for the bias, and its heads side by side make one matrix product, forward and back;
    a shifted probe adds its scale times the product of the shift's rows, so no probe's embeddings are materialised.
    """
    group, slot, crops = _step_groups(positions)
    n_groups, width, classes = len(crops), int(slot.max()) + 1, weight.shape[1]
    index, g, k = torch.from_numpy(stepping), torch.from_numpy(group), torch.from_numpy(slot)
    rows = torch.from_numpy(crops.reshape(-1))
    x = embeddings.plain.index_select(0, rows).view(n_groups, -1, embeddings.plain.shape[1])
    x = torch.cat([x, torch.ones(*x.shape[:2], 1)], dim=2)  # (G, B, D + 1)
    heads = torch.zeros(n_groups, width, classes, x.shape[2])
    heads[g, k] = optimizer.state[index, 0]  # weight and bias, side by side
    stacked = heads.view(n_groups, width * classes, -1)
    logits = torch.bmm(x, stacked.transpose(1, 2)).view(n_groups, -1, width, classes)[g, :, k]  # (P, B, C)
    scale = shift[index]
    shifted = embeddings.shift is not None and bool(scale.any())
    if shifted:
        moved = embeddings.shift.index_select(0, rows).float().view(n_groups, -1, embeddings.shift.shape[1])
        scales = torch.zeros(n_groups, width)
        scales[g, k] = scale
        logits += scale[:, None, None] * torch.bmm(moved, stacked[..., :-1].transpose(1, 2)).view(
            n_groups, -1, width, classes)[g, :, k]
    weights = torch.from_numpy(mask)
    error = torch.softmax(logits, dim=-1)
    error.scatter_add_(-1, torch.from_numpy(labels)[..., None], -torch.ones_like(error[..., :1]))
    error *= (weights / weights.sum(dim=1, keepdim=True))[..., None]  # the mean over each probe's batch
    errors = torch.zeros(n_groups, x.shape[1], width, classes)
    errors[g, :, k] = error
    errors = errors.view(n_groups, x.shape[1], width * classes)
    grad = torch.bmm(errors.transpose(1, 2), x).view(n_groups, width, classes, -1)[g, k]  # (P, C, D + 1)
    if shifted:
        grad[..., :-1] += torch.bmm((errors.view(n_groups, -1, width, classes) * scales[:, None, :, None]).view(
            errors.shape).transpose(1, 2), moved).view(n_groups, width, classes, -1)[g, k]
    if recipe.gradient_clip_val:
        grad *= clip_coefficient(torch.linalg.vector_norm(grad, dim=(1, 2)), recipe.gradient_clip_val)[:, None, None]
    lr = torch.tensor([recipe.head_lr * warmup_cosine(int(optimizer.steps[i]),
                                                      int(round(recipe.warmup_epochs * batches[i])),
                                                      recipe.max_epochs * int(batches[i])) for i in stepping],
                      dtype=torch.float64)
    optimizer.step(index, lr, grad)


def _step_groups(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The probes of one step grouped by the crops they read: each probe's group and its slot in it, and each
    group's crops."""
    crops, group = np.unique(positions, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(group))[:-1]])
    slot = np.empty(len(group), dtype=np.int64)
    slot[order] = np.arange(len(group)) - starts[group[order]]
    return group, slot, crops


def _validate(embeddings: Embeddings, spec: ProbeSpec, weight: torch.Tensor, bias: torch.Tensor,
              shift: float) -> float:
    """One probe's validation video AUROC now."""
    with torch.no_grad():
        x = embeddings.rows(torch.from_numpy(np.array(spec.val))[None], torch.tensor([shift]))[0]
        probabilities = torch.softmax(x @ weight.T + bias, dim=1)[:, 1].numpy()
    return video_auroc(spec, probabilities)


