"""Metrics for graded pain: a video's level (BL1 = 0 < PA1 < ... < PA4) called against its true level.

Beside accuracy and macro-F1: the mean absolute error over levels (calling PA4 "BL1" costs four times calling it
"PA3"), quadratic-weighted kappa (agreement beyond chance, disagreements weighted by the squared level distance) and
Spearman's rank correlation within each subject between the true level and the model's graded score (one person's
videos on one model's scale; then averaged over subjects). Pooled over the test videos and per fold, each with a
subject-bootstrap interval drawn as `statistics.subject_intervals` draws its own: a resample of subjects sums their
confusion counts (`statistics._count_bootstrap`), so MAE, kappa, accuracy and macro-F1 come from summed confusions.

The tables hold one row per video: `subject_name`, `label` (the true level's index among the task's classes, in
level order: `data.tasks.graded_levels` checks a task), `pred` (the level called) and, for Spearman, `score` (a graded
score: the expected level, a regression output). A subject with a single true level, or whose scores are all equal,
has no within-subject correlation: it is counted and reported, never silently dropped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from pipeline.evaluation.metrics import plot_confusion
from pipeline.evaluation.statistics import _confusions, _count_bootstrap, _nanmean_last
from pipeline.utils.atomic_io import atomic_write_csv

GRADED_METRICS = ("mae", "qwk", "accuracy", "macro_f1")
SPEARMAN = "spearman_within_subject"
# why a subject has no within-subject Spearman; "ok" where it has one
SINGLE_LEVEL, CONSTANT_SCORE = "single_level", "constant_score"


def _levels(n_levels: int) -> np.ndarray:
    return np.arange(n_levels, dtype=float)


def mae_of(confusion: np.ndarray) -> np.ndarray:
    """Mean absolute error over levels of confusion counts (..., K, K) (true level on rows)."""
    levels = _levels(confusion.shape[-1])
    distance = np.abs(levels[:, None] - levels[None, :])
    return (confusion * distance).sum(axis=(-2, -1)) / confusion.sum(axis=(-2, -1))


def qwk_of(confusion: np.ndarray) -> np.ndarray:
    """Quadratic-weighted kappa of confusion counts (..., K, K): 1 - sum(w O) / sum(w E), w = (i - j)^2, E the
    counts expected from the margins; NaN where E has no weight (one level called and true). Every level 0..K-1
    counts, present or not, as with scikit-learn's `cohen_kappa_score(labels=range(K), weights="quadratic")`."""
    levels = _levels(confusion.shape[-1])
    weights = (levels[:, None] - levels[None, :]) ** 2
    total = confusion.sum(axis=(-2, -1), keepdims=True)
    expected = confusion.sum(axis=-1, keepdims=True) * confusion.sum(axis=-2, keepdims=True) / total
    with np.errstate(invalid="ignore", divide="ignore"):
        return 1.0 - (weights * confusion).sum(axis=(-2, -1)) / (weights * expected).sum(axis=(-2, -1))


def accuracy_of(confusion: np.ndarray) -> np.ndarray:
    return np.trace(confusion, axis1=-2, axis2=-1) / confusion.sum(axis=(-2, -1))


def macro_f1_of(confusion: np.ndarray) -> np.ndarray:
    """Macro-F1 over the levels that are true or called (scikit-learn's `f1_score(average="macro")`): per level
    2 TP / (true + called)."""
    true, called = confusion.sum(axis=-1), confusion.sum(axis=-2)
    hits = np.diagonal(confusion, axis1=-2, axis2=-1)
    present = (true + called) > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(present, 2 * hits / np.where(present, true + called, 1), 0.0)
    return f1.sum(axis=-1) / present.sum(axis=-1)


METRIC_OF = {"mae": mae_of, "qwk": qwk_of, "accuracy": accuracy_of, "macro_f1": macro_f1_of}


def expected_level(probs: np.ndarray) -> np.ndarray:
    """The mean level under the level probabilities (N, K): a graded score for Spearman."""
    probs = np.asarray(probs, dtype=float)
    return probs @ _levels(probs.shape[1])


def _check_videos(videos: pd.DataFrame, columns: Sequence[str], n_levels: int | None) -> None:
    """The columns are there, and (with `n_levels`) `label` and `pred` are levels; else an error naming the row."""
    missing = [column for column in columns if column not in videos.columns]
    if missing:
        raise ValueError(f"graded video table is missing columns {missing}; it has {list(videos.columns)}")
    for column in ("label", "pred"):
        if column in columns and n_levels is not None:
            values = videos[column].to_numpy()
            bad = np.flatnonzero(~np.isin(values, np.arange(n_levels)))
            if len(bad):
                row = videos.iloc[int(bad[0])]
                raise ValueError(f"graded video table: {column}={values[bad[0]]} is not a level 0..{n_levels - 1} "
                                 f"in {len(bad)} row(s), the first row {int(bad[0])} "
                                 f"({row.get('subject_name')}/{row.get('sample_name', '?')})")


@dataclass(frozen=True)
class SpearmanWithinSubject:
    """Spearman's rho per subject (`per_subject`: subject_name, n_videos, rho, status) and their mean over the
    subjects that have one, with the count of those that do not and why."""

    per_subject: pd.DataFrame
    mean: float
    n_subjects: int
    n_single_level: int
    n_constant_score: int

    def summary(self) -> dict[str, float]:
        return {SPEARMAN: self.mean, f"{SPEARMAN}_n_subjects": float(self.n_subjects),
                f"{SPEARMAN}_n_single_level": float(self.n_single_level),
                f"{SPEARMAN}_n_constant_score": float(self.n_constant_score)}


def spearman_within_subject(videos: pd.DataFrame) -> SpearmanWithinSubject:
    """Spearman's rho between `label` and `score` among each subject's videos (scipy), then the mean over subjects;
    subjects with one true level or constant scores get NaN, a status, and a count."""
    _check_videos(videos, ["subject_name", "label", "score"], None)
    rows = []
    for subject, group in videos.groupby("subject_name", sort=True):
        labels, scores = group["label"].to_numpy(dtype=float), group["score"].to_numpy(dtype=float)
        if len(np.unique(labels)) < 2:
            rho, status = float("nan"), SINGLE_LEVEL
        elif len(np.unique(scores)) < 2:
            rho, status = float("nan"), CONSTANT_SCORE
        else:
            rho, status = float(stats.spearmanr(labels, scores).statistic), "ok"
        rows.append({"subject_name": subject, "n_videos": len(group), "rho": rho, "status": status})
    table = pd.DataFrame(rows, columns=["subject_name", "n_videos", "rho", "status"])
    used = table["status"] == "ok"
    return SpearmanWithinSubject(table, float(table.loc[used, "rho"].mean()) if used.any() else float("nan"),
                                 int(used.sum()), int((table["status"] == SINGLE_LEVEL).sum()),
                                 int((table["status"] == CONSTANT_SCORE).sum()))


def _of_summed(metric: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """A statistic of per-subject confusions (..., subjects, K, K): the metric of their sum (a resample's videos)."""
    return lambda picked: metric(picked.sum(axis=-3))


def graded_metrics(videos: pd.DataFrame, n_levels: int, **options) -> dict[str, float]:
    """MAE, quadratic-weighted kappa, accuracy and macro-F1 of the videos' called levels, and (with a `score` column)
    the within-subject Spearman with its counts; each metric with its subject-bootstrap interval (`<metric>`,
    `<metric>_ci95_low`, `<metric>_ci95_high`; NaN with fewer than two subjects). `options` go to the bootstrap."""
    _check_videos(videos, ["subject_name", "label", "pred"], n_levels)
    if videos.empty:
        raise ValueError("graded video table is empty: no videos to score")
    confusions = _confusions(videos["label"].to_numpy(dtype=int), videos["pred"].to_numpy(dtype=int),
                             videos["subject_name"].to_numpy(), n_levels)
    estimates = [(name, confusions, _of_summed(METRIC_OF[name])) for name in GRADED_METRICS]
    result: dict[str, float] = {}
    if "score" in videos.columns:
        spearman = spearman_within_subject(videos)
        result.update(spearman.summary())
        estimates.append((SPEARMAN, spearman.per_subject["rho"].to_numpy(dtype=float), _nanmean_last))
    for name, values, statistic in estimates:
        value = float(statistic(values))
        low, high = _count_bootstrap(values, statistic, **options) if np.isfinite(value) else (np.nan, np.nan)
        result.update({name: value, f"{name}_ci95_low": low, f"{name}_ci95_high": high})
    return result


def graded_table(videos: pd.DataFrame, n_levels: int, **options) -> pd.DataFrame:
    """`graded_metrics` pooled over every test video and per fold (a `fold` column), one row per scope and metric:
    scope (`pooled`, `fold <i>`), metric, value, ci95_low, ci95_high, n_subjects, n_videos."""
    scopes = [("pooled", videos)]
    if "fold" in videos.columns:
        scopes += [(f"fold {fold}", part) for fold, part in videos.groupby("fold", sort=True)]
    rows = []
    for scope, part in scopes:
        metrics = graded_metrics(part, n_levels, **options)
        names = [name for name in metrics if f"{name}_ci95_low" in metrics]
        rows += [{"scope": scope, "metric": name, "value": metrics[name], "ci95_low": metrics[f"{name}_ci95_low"],
                  "ci95_high": metrics[f"{name}_ci95_high"], "n_subjects": int(part["subject_name"].nunique()),
                  "n_videos": len(part)} for name in names]
        rows += [{"scope": scope, "metric": name, "value": value, "ci95_low": np.nan, "ci95_high": np.nan,
                  "n_subjects": int(part["subject_name"].nunique()), "n_videos": len(part)}
                 for name, value in metrics.items() if name.startswith(f"{SPEARMAN}_n_")]
    return pd.DataFrame(rows, columns=["scope", "metric", "value", "ci95_low", "ci95_high", "n_subjects", "n_videos"])


def level_confusion(videos: pd.DataFrame, class_names: Sequence[str]) -> pd.DataFrame:
    """Video counts, true level on rows and called level on columns, both in level order (`class_names` is the
    task's classes in level order)."""
    n_levels = len(class_names)
    _check_videos(videos, ["label", "pred"], n_levels)
    counts = np.zeros((n_levels, n_levels), dtype=np.int64)
    np.add.at(counts, (videos["label"].to_numpy(dtype=int), videos["pred"].to_numpy(dtype=int)), 1)
    return pd.DataFrame(counts, index=pd.Index(list(class_names), name="true"),
                        columns=[f"called_{name}" for name in class_names])


def write_level_confusion(videos: pd.DataFrame, class_names: Sequence[str], folder: str | os.PathLike, stem: str,
                          title: str = "", plot: bool = True) -> tuple[Path, Path]:
    """The level-ordered confusion matrix as `<stem>.csv` and (`plot`) `<stem>.png` in `folder`, both written
    atomically."""
    table = level_confusion(videos, class_names)
    folder = Path(folder)
    csv_path, png_path = folder / f"{stem}.csv", folder / f"{stem}.png"
    atomic_write_csv(csv_path, table.reset_index())
    if plot:
        plot_confusion(table.to_numpy(), class_names, png_path, title=title)
    return csv_path, png_path


def decided_levels(videos: pd.DataFrame, class_names: Sequence[str]) -> pd.DataFrame:
    """A fold's (or a CV's) test videos as a graded table: `pred` the level each video was called as the call was
    made (`decision`: the fold's threshold on a binary task, argmax or an ordinal model's `ordinal_decision`;
    `pred` where there is none) and `score` its expected level under its `prob_<class>` (`class_names` in level
    order), Spearman's graded score."""
    probs = videos[[f"prob_{name}" for name in class_names]].to_numpy(dtype=float)
    called = videos["decision"] if "decision" in videos.columns else videos["pred"]
    return videos.assign(pred=called.to_numpy(dtype=int), score=expected_level(probs))


def _named(metrics: dict[str, float]) -> dict[str, float]:
    """Graded metrics as a run logs them, `video_<metric>`; accuracy left out (a fold logs `video_accuracy`, and
    `video_accuracy_at_threshold` for the calls at its threshold, already)."""
    return {f"video_{name}": value for name, value in metrics.items() if not name.startswith("accuracy")}


def fold_graded_metrics(videos: pd.DataFrame, class_names: Sequence[str], **options) -> dict[str, float]:
    """A fold's graded metrics of its test videos (`decided_levels`), each with its subject-bootstrap interval:
    `video_mae`, `video_qwk`, `video_macro_f1`, `video_spearman_within_subject` and its counts."""
    return _named(graded_metrics(decided_levels(videos, class_names), len(class_names), **options))


def cv_graded_table(videos: pd.DataFrame, class_names: Sequence[str],
                    **options) -> tuple[pd.DataFrame, dict[str, float]]:
    """A CV's test videos of every fold (a `fold` column) as `graded_table` (pooled and per fold), and its pooled
    rows as the parent run logs them: `pooled/video_<metric>` with `_ci95_low` and `_ci95_high` (subject bootstrap)."""
    table = graded_table(decided_levels(videos, class_names), len(class_names), **options)
    summary: dict[str, float] = {}
    for row in table[table["scope"] == "pooled"].itertuples(index=False):
        values = {str(row.metric): float(row.value)}
        if not str(row.metric).startswith(f"{SPEARMAN}_n_"):
            values |= {f"{row.metric}_ci95_low": float(row.ci95_low), f"{row.metric}_ci95_high": float(row.ci95_high)}
        summary |= {f"pooled/{name}": value for name, value in _named(values).items()}
    return table, summary
