"""The statistics of a comparison (`make compare`): per-fold scores described (mean and sd over folds, paired
differences, not tested: folds share training subjects), and the tests that pair subjects instead (every tested
subject is tested once): each subject metric with its subject-bootstrap interval, within-subject permutation tests
Holm-adjusted over every pair and metric, the smallest effect each test could see, and the calibration of the pooled
test videos. Pure functions of tables (`pipeline.evaluation.statistics` underneath).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np
import pandas as pd

from pipeline.evaluation.graded import decided_levels, graded_metrics
from pipeline.evaluation.statistics import (
    CALIBRATION_METRICS,
    SUBJECT_METRICS,
    calibration_intervals,
    decided_by,
    holm,
    minimum_detectable_effect,
    paired_permutation_test,
    seed_aware_difference_interval,
    smallest_signed_rank_p,
    subject_intervals,
    subject_scores,
)

SUMMARY_COLUMNS = ["model", "metric", "mean", "std", "n_folds"]
PAIRED_COLUMNS = ["metric", "model_a", "model_b", "n_folds", "mean_diff", "std_diff", "note"]
SUBJECT_COLUMNS = ["model", "metric", "value", "ci95_low", "ci95_high", "n_subjects", "decided_by"]
SUBJECT_PAIRED_COLUMNS = ["metric", "model_a", "model_b", "n_subjects", "mean_diff", "diff_ci95_low",
                          "diff_ci95_high", "interval", "p_value", "p_holm", "mde80", "primary"]
FAMILY_ALPHA = 0.05  # the family-wise error rate Holm's correction holds
MDE_POWER = 0.8  # the power the minimum detectable effect (`mde80`) is stated for
PRIMARY_METRIC = "accuracy_at_threshold"  # pooled/video_accuracy_at_threshold: the one number set beside papers
# compare.metric may name a graded metric as the primary one instead: then it joins the subject metrics (each
# subject's mean absolute error over levels of its videos' calls, `graded`), and only then (a default comparison's
# family of tests is unchanged)
GRADED_SUBJECT_METRICS = ("mae",)
PRIMARY_CHOICES = (PRIMARY_METRIC, *(m for m in SUBJECT_METRICS if m != PRIMARY_METRIC), *GRADED_SUBJECT_METRICS)


def summary_table(scores: pd.DataFrame, metrics: Sequence[str]) -> pd.DataFrame:
    """Per model and metric: mean, sd (ddof=1) and the number of folds. No interval over folds: they share training
    subjects, so they are not independent samples; the intervals are the subject bootstraps (`subject_table`)."""
    rows = []
    for model, model_scores in scores.groupby("model", sort=True):
        for metric in metrics:
            values = model_scores[metric].dropna().to_numpy(dtype=float)
            rows.append({"model": model, "metric": metric, "mean": float(values.mean()) if len(values) else np.nan,
                         "std": float(values.std(ddof=1)) if len(values) > 1 else (0.0 if len(values) else np.nan),
                         "n_folds": len(values)})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def fold_test_note(n: int) -> str:
    """Why the folds are not tested, with the floor of an exact signed-rank p-value over n of them."""
    return (f"not tested over folds: they share training subjects, and {n} paired folds give an exact two-sided "
            f"signed-rank p of at least 2/2^{n} = {smallest_signed_rank_p(n):.4g}; see the subject-level tests")


def paired_tests(scores: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Every pair of models on the folds both have: mean and sd of (a - b), described, not tested (`note`)."""
    wide = scores.pivot(index="fold", columns="model", values=metric)
    rows = []
    for model_a, model_b in combinations(sorted(wide.columns), 2):
        pair = wide[[model_a, model_b]].dropna()
        differences = (pair[model_a] - pair[model_b]).to_numpy(dtype=float)
        n = len(differences)
        rows.append({"metric": metric, "model_a": model_a, "model_b": model_b, "n_folds": n,
                     "mean_diff": float(differences.mean()) if n else np.nan,
                     "std_diff": float(differences.std(ddof=1)) if n > 1 else (0.0 if n == 1 else np.nan),
                     "note": fold_test_note(n)})
    return pd.DataFrame(rows, columns=PAIRED_COLUMNS)


def graded_subject_scores(videos: pd.DataFrame, class_names: Sequence[str]) -> pd.DataFrame:
    """Per subject: the mean absolute error over levels of its videos' calls as made (`graded.decided_levels`; the
    task's classes in level order)."""
    levels = decided_levels(videos, class_names)
    errors = (levels["label"] - levels["pred"]).abs()
    return errors.groupby(levels["subject_name"], sort=True).mean().rename("mae").reset_index()


def subject_tables(videos: Mapping[str, pd.DataFrame],
                   primary: str = PRIMARY_METRIC) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per model: each subject metric with its subject-bootstrap interval; per subject: the scores; per pair of
    models and metric: the within-subject permutation test over the subjects both have, Holm-adjusted over all.
    `primary` (`compare.metric`): the metric flagged primary; a graded one (`mae`) joins the subject metrics."""
    graded = primary in GRADED_SUBJECT_METRICS
    metrics = (*SUBJECT_METRICS, *GRADED_SUBJECT_METRICS) if graded else SUBJECT_METRICS
    intervals, per_subject = [], []
    for model, table in videos.items():
        class_names = [column.removeprefix("prob_") for column in table.columns if column.startswith("prob_")]
        result = subject_intervals(table, class_names)
        if graded:  # pooled MAE with its subject-bootstrap interval (summed per-subject confusions)
            result |= {k: v for k, v in graded_metrics(decided_levels(table, class_names), len(class_names)).items()
                       if k.startswith("mae")}
        n_subjects = table["subject_name"].nunique()
        # a run that logged no decisions was called by argmax: its "at threshold" rows say so
        intervals += [{"model": model, "metric": metric, "value": result[metric], "n_subjects": n_subjects,
                       "decided_by": decided_by(table),
                       "ci95_low": result[f"{metric}_ci95_low"], "ci95_high": result[f"{metric}_ci95_high"]}
                      for metric in metrics]
        scores_of = subject_scores(table, class_names)
        if graded:
            scores_of = scores_of.merge(graded_subject_scores(table, class_names), on="subject_name", how="left")
        per_subject.append(scores_of.assign(model=model))
    scores = pd.concat(per_subject, ignore_index=True) if per_subject else pd.DataFrame()
    by_seed = {model: seed_scores(table, graded) for model, table in videos.items()}
    several_seeds = any(table["seed"].nunique() > 1 for table in by_seed.values())
    paired = []
    for model_a, model_b in combinations(sorted(videos), 2):
        for metric in metrics:
            wide = scores.pivot(index="subject_name", columns="model", values=metric)[[model_a, model_b]].dropna()
            mean_diff, p_value = paired_permutation_test(wide[model_a].to_numpy(), wide[model_b].to_numpy())
            a, b = (by_seed[m].pivot(index="subject_name", columns="seed", values=metric) for m in (model_a, model_b))
            both = a.dropna().index.intersection(b.dropna().index)
            low, high = seed_aware_difference_interval(a.loc[both].to_numpy(), b.loc[both].to_numpy())
            paired.append({"metric": metric, "model_a": model_a, "model_b": model_b, "n_subjects": len(wide),
                           "mean_diff": mean_diff, "diff_ci95_low": low, "diff_ci95_high": high,
                           "interval": "bootstrap over subjects and seeds" if several_seeds else
                           "bootstrap over subjects (trained models fixed)",
                           "p_value": p_value, "primary": metric == primary})
    paired_table = pd.DataFrame(paired, columns=SUBJECT_PAIRED_COLUMNS)
    paired_table["p_holm"] = holm(paired_table["p_value"].to_numpy(dtype=float)) if len(paired_table) else []
    # what the test could have seen: at Holm's strictest level (its first step, alpha / family size), 80 % power
    alpha = FAMILY_ALPHA / max(1, int(paired_table["p_value"].notna().sum()))
    paired_table["mde80"] = [minimum_detectable_effect(scores.pivot(index="subject_name", columns="model",
                                                                    values=row.metric)[[row.model_a, row.model_b]]
                                                       .dropna().pipe(lambda w, r=row: w[r.model_a] - w[r.model_b]),
                                                       alpha, MDE_POWER)
                             for row in paired_table.itertuples()]
    return pd.DataFrame(intervals, columns=SUBJECT_COLUMNS), scores, paired_table


def seed_scores(videos: pd.DataFrame, graded: bool = False) -> pd.DataFrame:
    """The subject metrics per subject and training seed (one seed, 0, for a CV without `cv.seeds`); `graded`: with
    each subject's MAE over levels too."""
    class_names = [column.removeprefix("prob_") for column in videos.columns if column.startswith("prob_")]
    if "seed" not in videos.columns:
        videos = videos.assign(seed=0)
    parts = []
    for seed, part in videos.groupby("seed", sort=True):
        scores = subject_scores(part.drop(columns="seed"), class_names)
        if graded:
            scores = scores.merge(graded_subject_scores(part, class_names), on="subject_name", how="left")
        parts.append(scores.assign(seed=seed))
    return pd.concat(parts, ignore_index=True)


CALIBRATION_NOTE = "pooled over the CV's fold models, each with its own probability scale"


def calibration_table(videos: Mapping[str, pd.DataFrame], folds: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per CV with pooled test videos: Brier and ECE of those videos with their subject-bootstrap intervals
    (`statistics.calibration_intervals`), and beside them the mean over folds of each fold model's own (`folds`: the
    CV's `test/video_brier`, `test/video_ece` per fold run, `comparison_runs.fold_scores`): pooling mixes the fold
    models."""
    rows = []
    for model, table in videos.items():
        class_names = [column.removeprefix("prob_") for column in table.columns if column.startswith("prob_")]
        pooled = calibration_intervals(table, class_names)
        row = {"model": model, "n_subjects": table["subject_name"].nunique(), "n_folds": len(folds[model])}
        for name in CALIBRATION_METRICS:
            row.update({name: pooled[name], f"{name}_ci95_low": pooled[f"{name}_ci95_low"],
                        f"{name}_ci95_high": pooled[f"{name}_ci95_high"],
                        f"{name}_mean_over_folds": float(folds[model][f"test/video_{name}"].mean())})
        rows.append({**row, "note": CALIBRATION_NOTE})
    return pd.DataFrame(rows)
