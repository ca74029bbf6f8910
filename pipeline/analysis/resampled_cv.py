"""The cross-validations of one replicate, in memory: a fold file's folds over a replicate's people
(`population.ReplicateDataModule`), every configuration's probes of every fold and training seed fitted at once
(`probe_batch.fit_probes`: the in-memory probe's recipe), each fold's threshold chosen on its validation videos by
the CV's rule (`thresholds.choose_threshold`), and the test videos called at it: per configuration the pooled test
videos a CV logs (`predictions_videos_all_folds.csv`: subject, sample, label, probabilities, threshold, decision,
fold, and seed with several), which `make compare`'s paired test reads. Also each configuration's accuracy on the
rest of the population (`population_accuracy`), the truth a replicate's difference estimates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import sparse
from torch import nn

from pipeline.analysis.population import PERSON, Population, ReplicateDataModule
from pipeline.data.datamodule import LoaderConfig
from pipeline.data.tasks import Task
from pipeline.evaluation.metrics import VIDEO_KEYS
from pipeline.evaluation.thresholds import choose_threshold
from pipeline.models.probe_batch import BatchFit, BatchRecipe, Embeddings, ProbeSpec, fit_probes
from pipeline.utils.seeds import derived_seed

HEAD_STREAM = 7  # the head's initial weights: drawn from (training seed, this)
CHUNK = 20_000  # population crops scored at a time (their embeddings copied once per chunk)


@dataclass(frozen=True)
class FoldSplit:
    """One fold of a replicate as positions into the population's embeddings: training crops with labels, and the
    validation and test crops with the video each belongs to (`*_videos`: the videos' table, one row each)."""

    fold: int
    train: np.ndarray
    train_labels: np.ndarray
    val: np.ndarray
    val_codes: np.ndarray
    val_videos: pd.DataFrame  # subject_name, sample_name, label
    test: np.ndarray
    test_codes: np.ndarray
    test_videos: pd.DataFrame

    @classmethod
    def of(cls, datamodule: ReplicateDataModule) -> FoldSplit:
        datamodule.setup()
        parts: dict[str, tuple] = {}
        for role in ("val", "test"):
            rows = datamodule.prediction_rows(role).loc[datamodule.dataset(role).rows]
            codes, _ = pd.factorize(pd.MultiIndex.from_frame(rows[VIDEO_KEYS]))
            videos = rows.groupby(codes)[[*VIDEO_KEYS, "label"]].first().reset_index(drop=True)
            parts[role] = (datamodule.dataset(role).rows, codes, videos)
        train = datamodule.dataset("train")
        return cls(datamodule.fold, train.rows, train.labels, *parts["val"], *parts["test"])


@dataclass(frozen=True)
class Copy:
    """One configuration of a comparison: its name, the scale of the shift added to its embeddings and its training
    seeds."""

    name: str
    shift: float
    seeds: tuple[int, ...]


def fold_splits(frames: pd.DataFrame, folds: pd.DataFrame, task: Task, data_config, loader: LoaderConfig,
                population: Population) -> list[FoldSplit]:
    """Every fold of the fold table over the replicate's frames, split as a CV's folds are."""
    return [FoldSplit.of(ReplicateDataModule(frames, folds, fold, task, data_config, loader, 0,
                                             population.embeddings))
            for fold in sorted(folds["fold"].unique())]


def initial_head(seed: int, features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh linear head's weights as torch initialises one, drawn from the training seed alone: a CV seeds every
    fold's model alike (`fold_job.build_fold`), so a seed's folds start from one head and differ in their data and
    order (`EpochSampler`: seed, fold, epoch)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(seed, HEAD_STREAM))
        head = nn.Linear(features, classes)
    return head.weight.detach().clone(), head.bias.detach().clone()


def probe_specs(splits: Sequence[FoldSplit], copies: Sequence[Copy], features: int,
                classes: int) -> list[tuple[Copy, int, FoldSplit, ProbeSpec]]:
    """Every probe of the replicate: each copy, each of its seeds, each fold."""
    specs = []
    for copy in copies:
        for seed in copy.seeds:
            for split in splits:
                weight, bias = initial_head(seed, features, classes)
                specs.append((copy, seed, split, ProbeSpec(
                    split.train, split.train_labels, split.val, split.val_codes,
                    split.val_videos["label"].to_numpy(), seed, split.fold, weight, bias, copy.shift)))
    return specs


def pain_probabilities(embeddings: Embeddings, positions: np.ndarray, weight: torch.Tensor, bias: torch.Tensor,
                       shift: np.ndarray) -> np.ndarray:
    """The probability of pain (the second class) of the crops at `positions` under each of k fitted two-class heads
    (weight (k, 2, D), bias (k, 2), each head reading its embeddings shifted at its scale `shift`): (crops, k). Two
    classes have one logit gap, so each head is one direction: the crops' embeddings are read once for all heads."""
    direction = (weight[:, 1] - weight[:, 0]).T
    gap = np.zeros((len(positions), len(shift)), dtype=np.float64)
    with torch.no_grad():
        for chunk in np.array_split(np.arange(len(positions)), max(1, len(positions) // CHUNK)):
            rows = torch.from_numpy(np.ascontiguousarray(positions[chunk]))
            gap[chunk] = (embeddings.plain[rows] @ direction).numpy()
            if embeddings.shift is not None and shift.any():
                gap[chunk] += shift * (embeddings.shift[rows].float() @ direction).numpy()
    gap += (bias[:, 1] - bias[:, 0]).numpy()
    return 1.0 / (1.0 + np.exp(-gap))


def averaging_matrix(codes: np.ndarray, n_videos: int) -> sparse.csr_matrix:
    """(videos, crops): each video's row averages its crops (mean aggregation)."""
    counts = np.bincount(codes, minlength=n_videos)
    return sparse.csr_matrix((1.0 / counts[codes], (codes, np.arange(len(codes)))), shape=(n_videos, len(codes)))


def decided_fold(split: FoldSplit, embeddings: Embeddings, weight: torch.Tensor, bias: torch.Tensor,
                 shift: np.ndarray, class_names: Sequence[str], rule: str | float) -> list[pd.DataFrame]:
    """Each of the fold's k probes' test videos as a fold logs them: the mean probabilities, the probe's threshold
    chosen on its validation videos by `rule` (the CV's `eval.threshold`), each video's decision at it."""
    means = {role: averaging_matrix(codes, len(videos)) @ pain_probabilities(embeddings, positions, weight, bias, shift)
             for role, positions, codes, videos in (("val", split.val, split.val_codes, split.val_videos),
                                                    ("test", split.test, split.test_codes, split.test_videos))}
    labels = split.val_videos["label"].to_numpy() != 0
    n_subjects = split.val_videos["subject_name"].nunique()
    tables = []
    for probe in range(len(shift)):
        threshold = choose_threshold(labels, means["val"][:, probe], rule, n_subjects=n_subjects).threshold
        pain = means["test"][:, probe]
        tables.append(split.test_videos.assign(**{f"prob_{class_names[0]}": 1 - pain, f"prob_{class_names[1]}": pain,
                                                  "threshold": threshold, "decision": (pain >= threshold).astype(int),
                                                  "fold": split.fold}))
    return tables


@dataclass
class ReplicateFit:
    """What one replicate's probes produced: per copy its pooled test videos, and per probe its threshold."""

    videos: dict[str, pd.DataFrame]
    thresholds: np.ndarray  # per probe of `specs`
    specs: list[tuple[Copy, int, FoldSplit, ProbeSpec]]
    fit: BatchFit


def fit_replicate(splits: Sequence[FoldSplit], copies: Sequence[Copy], embeddings: Embeddings,
                  recipe: BatchRecipe, class_names: Sequence[str], rule: str | float) -> ReplicateFit:
    """Every copy's CV of the replicate: its probes fitted at once, then each fold decided as a CV decides it."""
    specs = probe_specs(splits, copies, embeddings.plain.shape[1], len(class_names))
    fit = fit_probes(embeddings, [spec for *_, spec in specs], recipe)
    parts: dict[str, list[pd.DataFrame]] = {copy.name: [] for copy in copies}
    thresholds = np.zeros(len(specs))
    for split in splits:
        probes = [i for i, (_, _, of, _) in enumerate(specs) if of is split]
        shift = np.array([specs[i][0].shift for i in probes])
        for i, videos in zip(probes, decided_fold(split, embeddings, fit.weight[probes], fit.bias[probes], shift,
                                                  class_names, rule), strict=True):
            copy, seed = specs[i][0], specs[i][1]
            thresholds[i] = float(videos["threshold"].iloc[0])
            parts[copy.name].append(videos.assign(seed=seed) if len(copy.seeds) > 1 else videos)
    return ReplicateFit({name: pd.concat(tables, ignore_index=True) for name, tables in parts.items()},
                        thresholds, specs, fit)


@dataclass(frozen=True)
class PopulationVideos:
    """The population's crops of the task's classes grouped into videos: their positions, each one's video, the
    videos' labels and people, and the matrix that averages a video's crops."""

    positions: np.ndarray
    people: np.ndarray  # per video
    labels: np.ndarray  # per video: pain (not the task's first class)
    averaging: sparse.csr_matrix  # (videos, crops)

    @classmethod
    def of(cls, population: Population, task: Task) -> PopulationVideos:
        frames = population.frames[population.frames["class_name"].isin(task.classes)]
        codes, _ = pd.factorize(pd.MultiIndex.from_frame(frames[[PERSON, "sample_name"]]))
        videos = frames.groupby(codes)[[PERSON, "class_name"]].first()
        return cls(frames.index.to_numpy(), videos[PERSON].to_numpy(), (videos["class_name"] != task.classes[0])
                   .to_numpy(), averaging_matrix(codes, len(videos)))


def population_accuracy(videos: PopulationVideos, embeddings: Embeddings, result: ReplicateFit,
                        drawn: Mapping[str, str]) -> dict[str, float]:
    """Each copy's mean accuracy at its probes' thresholds over the population's people outside the replicate
    (`drawn`: its slots' people): what each of its fold models would score on new people, averaged over its folds
    and seeds."""
    outside = ~np.isin(videos.people, list(drawn.values()))
    averaging = videos.averaging[outside]
    crops = np.flatnonzero(np.asarray(averaging.sum(axis=0)).ravel() > 0)
    shift = np.array([copy.shift for copy, *_ in result.specs])
    pain = averaging[:, crops] @ pain_probabilities(embeddings, videos.positions[crops], result.fit.weight,
                                                    result.fit.bias, shift)
    correct = ((pain >= result.thresholds) == videos.labels[outside][:, None]).mean(axis=0)
    names = [copy.name for copy, *_ in result.specs]
    return pd.Series(correct).groupby(names, sort=False).mean().to_dict()
