"""Which threshold rule to use, measured on real folds: every rule of `eval.threshold` applied, offline, to the
validation and test videos of each finished fold in an MLflow store.

A binary fold logs the videos its threshold is chosen on (`predictions_videos_val.csv`: the validation subjects, scored
by the best checkpoint) and the videos it is tested on (`predictions_videos.csv`). Here every rule sees the same two
tables of a fold: it chooses on the validation videos as the fold would (`choose_threshold`, its fallbacks included)
and is scored on the test videos. A rule's **regret** on a fold is the best cut's balanced accuracy on the fold's test
videos minus the balanced accuracy at the rule's threshold: what choosing on other people cost, against a cut that saw
the test labels. Folds that share people (one split of one fold file, over tasks and backbones) are one cluster; the
interval of a mean regret resamples clusters (a Monte-Carlo bootstrap), and the same draws serve every rule, so the
difference of two rules is paired.

This reads test labels, so it serves choosing the project's default rule (docs/numbers.md, "Which rule is the
default"), never a run's own threshold. scripts/threshold_regret.py runs the study and prints the table;
scripts/check_default_thresholds.py checks the default CVs' folds with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run
from sklearn.metrics import roc_auc_score

from pipeline.data.tasks import get_task
from pipeline.evaluation.thresholds import (
    binary_metrics_at,
    choose_threshold,
    measured_rules,
    roc_points,
    threshold_scores,
)
from pipeline.runs.jobs.fold_job import VAL_VIDEO_PREDICTIONS
from pipeline.runs.jobs.sealing import VIDEO_PREDICTIONS
from pipeline.runs.store import cv_runs, tracking

FIXED = 0.5  # the fixed cut compared beside the named rules (argmax on two classes)
CONFIDENCE = 0.95


def compared_rules() -> tuple[str | float, ...]:
    """Every rule of the registry that `eval.threshold` names (a second name of one rule once: `measured_rules`),
    and the fixed 0.5."""
    return (*measured_rules(), FIXED)


def rule_label(rule: str | float) -> str:
    """A rule as the tables name it: its name, or `fixed_<t>` for a number."""
    return rule if isinstance(rule, str) else f"fixed_{rule:g}"


@dataclass(frozen=True)
class FoldVideos:
    """What every rule sees of one fold: the validation videos it chooses on and the test videos it is scored on
    (0/1 labels, the positive-class score `threshold_scores` gives), and where the fold comes from."""

    cv_run: str
    fold_run: str
    fold: int
    seed: str  # the training seed's tag ("" when the CV trained once)
    dataset: str
    task: str
    model: str  # the CV's label (`cv_runs.cv_label`): backbone, what trained, the weights file it started from
    split: str  # which people: the fold file's SHA-256 and the fold, shared by every task and backbone on them
    validation_subjects: int
    val_labels: np.ndarray
    val_scores: np.ndarray
    test_labels: np.ndarray
    test_scores: np.ndarray


def best_balanced_accuracy(labels: np.ndarray, scores: np.ndarray) -> float:
    """The highest balanced accuracy any cut reaches on these videos (labels of both classes): the oracle's."""
    fpr, tpr, _ = roc_points(np.asarray(labels).astype(int), np.asarray(scores, dtype=float))
    return float(np.max((tpr + 1 - fpr) / 2))


def fold_rule_rows(fold: FoldVideos, rules: Sequence[str | float]) -> list[dict]:
    """One row per rule: the threshold it chooses on the fold's validation videos (and why it fell back, if it did),
    the test videos' balanced accuracy at it, the best cut's, the regret and the test video AUROC."""
    best = best_balanced_accuracy(fold.test_labels, fold.test_scores)
    auroc = float(roc_auc_score(fold.test_labels, fold.test_scores))
    rows = []
    for rule in rules:
        choice = choose_threshold(fold.val_labels, fold.val_scores, rule, n_subjects=fold.validation_subjects)
        accuracy = binary_metrics_at(fold.test_labels, fold.test_scores, choice.threshold)["balanced_accuracy"]
        rows.append({"cv_run": fold.cv_run, "fold_run": fold.fold_run, "fold": fold.fold, "seed": fold.seed,
                     "dataset": fold.dataset, "task": fold.task, "model": fold.model, "split": fold.split,
                     "validation_subjects": fold.validation_subjects, "validation_videos": len(fold.val_labels),
                     "test_videos": len(fold.test_labels), "video_auroc": auroc, "rule": rule_label(rule),
                     "threshold": choice.threshold, "fallback": choice.fallback, "balanced_accuracy": accuracy,
                     "best_balanced_accuracy": best, "regret": best - accuracy})
    return rows


def fold_videos(client: MlflowClient, parent: str, run: Run, tags: dict[str, str]) -> FoldVideos | None:
    """A finished fold run's validation and test videos; None for a task of more than two classes or a fold whose
    test videos hold one class (no cut to score: the caller counts them). Validation videos of one class stay: the
    rules fall back on them as the fold did."""
    task = get_task(tags[tracking.TASK_TAG])
    if not task.is_binary:
        return None
    fold_tags, run_id = run.data.tags, run.info.run_id
    val = pd.read_csv(client.download_artifacts(run_id, VAL_VIDEO_PREDICTIONS))
    test = pd.read_csv(client.download_artifacts(run_id, VIDEO_PREDICTIONS))
    val_labels, val_scores = threshold_scores(val, task.classes)
    test_labels, test_scores = threshold_scores(test, task.classes)
    if len(np.unique(test_labels)) < 2:
        return None
    fold = int(fold_tags[tracking.FOLD_TAG])
    return FoldVideos(parent, run_id, fold, fold_tags.get(tracking.SEED_TAG, ""), tags.get(tracking.DATASET_TAG, ""),
                      task.name, cv_runs.cv_label(tags), f"{tags.get(tracking.FOLD_FILE_TAG, '')[:12]}:{fold}",
                      int(val["subject_name"].nunique()), val_labels, val_scores, test_labels, test_scores)


FOLD_IDENTITY = ["dataset", "task", "model", "split", "seed"]  # one fold's training, whichever CV ran it


def one_run_per_fold(rows: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The rows with every fold counted once: a store can hold one fold trained twice (the same task, split, training
    seed and model, run again after a setting that changes no training, such as `eval.threshold`, made it another
    CV), and counting both would weigh that split twice. The CV listed first in `rows` keeps the fold; the number of
    folds left out is returned beside."""
    if rows.empty:
        return rows, 0
    first = rows.groupby(FOLD_IDENTITY, sort=False)["cv_run"].transform("first")
    kept = rows[rows["cv_run"] == first]
    return kept, (len(rows) - len(kept)) // max(1, rows["rule"].nunique())


def cv_folds(client: MlflowClient, parent_run_id: str) -> tuple[list[FoldVideos], int]:
    """Every finished fold of a CV (each training seed's, newest attempt) that a threshold can be scored on, and how
    many finished folds were left out (a multiclass task, one class among a fold's test videos)."""
    tags = client.get_run(parent_run_id).data.tags
    newest: dict[tuple[str, str], Run] = {}
    for run in tracking.fold_runs(client, parent_run_id):  # newest first
        if run.info.status == tracking.FINISHED:
            newest.setdefault((run.data.tags[tracking.FOLD_TAG], run.data.tags.get(tracking.SEED_TAG, "")), run)
    folds = [fold_videos(client, parent_run_id, run, tags) for run in newest.values()]
    kept = [fold for fold in folds if fold is not None]
    return sorted(kept, key=lambda fold: (fold.fold, fold.seed)), len(folds) - len(kept)


def regret_rows(client: MlflowClient, parent_run_ids: Iterable[str],
                rules: Sequence[str | float] | None = None) -> tuple[pd.DataFrame, int]:
    """Every rule on every usable fold of these CVs (`fold_rule_rows`), and the number of folds left out."""
    rules = compared_rules() if rules is None else rules
    rows, skipped = [], 0
    for parent in parent_run_ids:
        folds, left_out = cv_folds(client, parent)
        skipped += left_out
        for fold in folds:
            rows += fold_rule_rows(fold, rules)
    return pd.DataFrame(rows), skipped


def cluster_draws(clusters: np.ndarray, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The cluster index of each fold and `resamples` bootstrap draws of whole clusters (rows: draws)."""
    names, index = np.unique(clusters, return_inverse=True)
    draws = np.random.default_rng(seed).integers(0, len(names), size=(resamples, len(names)))
    return index, draws


def resampled_means(values: np.ndarray, index: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The mean of `values` (one per fold) over the folds of each draw's clusters."""
    sums = np.bincount(index, weights=values, minlength=draws.shape[1])
    counts = np.bincount(index, minlength=draws.shape[1])
    return sums[draws].sum(axis=1) / counts[draws].sum(axis=1)


def regret_table(rows: pd.DataFrame, by: Sequence[str], resamples: int, seed: int) -> pd.DataFrame:
    """Per group of `by` and rule: folds, clusters (splits), mean regret (points) with its Monte-Carlo interval
    (clusters resampled), the worst fold's and the 90th percentile's regret, mean balanced accuracy, and the
    paired difference to the group's best rule (by mean regret) with its interval. Sorted by mean regret."""
    low_q, high_q = 100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2
    table = []
    for key, group in rows.groupby(list(by), sort=True):
        wide = group.pivot_table(index=["cv_run", "fold", "seed", "split"], columns="rule", values="regret")
        index, draws = cluster_draws(wide.index.get_level_values("split").to_numpy(), resamples, seed)
        means = {rule: resampled_means(wide[rule].to_numpy(), index, draws) for rule in wide.columns}
        best = min(wide.columns, key=lambda rule: wide[rule].mean())
        accuracy = group.groupby("rule")["balanced_accuracy"].mean()
        for rule in wide.columns:
            values, difference = wide[rule].to_numpy(), means[rule] - means[best]
            table.append({**dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True)), "rule": rule,
                          "folds": len(values), "clusters": draws.shape[1], "regret": 100 * values.mean(),
                          "regret_low": 100 * np.percentile(means[rule], low_q),
                          "regret_high": 100 * np.percentile(means[rule], high_q),
                          "worst": 100 * values.max(), "p90": 100 * np.percentile(values, 90),
                          "balanced_accuracy": 100 * accuracy[rule], "versus_best": best,
                          "difference": 100 * (values.mean() - wide[best].mean()),
                          "difference_low": 100 * np.percentile(difference, low_q),
                          "difference_high": 100 * np.percentile(difference, high_q)})
    return pd.DataFrame(table).sort_values([*by, "regret"], kind="stable").reset_index(drop=True)


def failing_folds(rows: pd.DataFrame, rule: str, auroc_floor: float, accuracy_floor: float) -> pd.DataFrame:
    """The folds where `rule` wastes a model that ranks well: test video AUROC >= `auroc_floor` but balanced
    accuracy at the rule's threshold under `accuracy_floor` (issue 43's check of the default CVs)."""
    chosen = rows[rows["rule"] == rule]
    return chosen[(chosen["video_auroc"] >= auroc_floor) & (chosen["balanced_accuracy"] < accuracy_floor)]
