"""The statistics of a comparison (`make compare`): per-fold scores described (mean and sd over folds, paired
differences, not tested on their own: five of them cannot reach 0.05), and the tests that pair subjects instead
(every tested subject is tested once): each subject metric with its subject-bootstrap interval, each pair's paired
test over subjects grouped by the fold that tested them (`statistics.paired_test`: a fold's test subjects share its
trained models), Holm-adjusted over the primary metric's tests alone (one a pair; the secondary metrics beside them,
uncorrected), the smallest effect each test could see, and the calibration of the pooled test videos. Pure functions
of tables (`pipeline.evaluation.statistics` underneath).
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
    paired_test,
    smallest_signed_rank_p,
    subject_intervals,
    subject_scores,
)

SUMMARY_COLUMNS = ["model", "metric", "mean", "std", "n_folds"]
PAIRED_COLUMNS = ["metric", "model_a", "model_b", "n_folds", "mean_diff", "std_diff", "note"]
SUBJECT_COLUMNS = ["model", "metric", "value", "ci95_low", "ci95_high", "n_subjects", "decided_by"]
SUBJECT_PAIRED_COLUMNS = ["metric", "model_a", "model_b", "n_subjects", "unit", "n_units", "mean_diff",
                          "diff_ci95_low", "diff_ci95_high", "p_value", "p_holm", "mde80", "primary", "family",
                          "standard_error", "df"]
FOLD_UNIT, SUBJECT_UNIT = "fold", "subject"  # what a paired test's differences are grouped by (`pairing_units`)
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


def subject_tables(videos: Mapping[str, pd.DataFrame], primary: str = PRIMARY_METRIC,
                   test_folds: Mapping[str, int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per model: each subject metric with its subject-bootstrap interval; per subject: the scores; per pair of
    models and metric: the paired test over the subjects both have, grouped by the fold that tested them
    (`pair_row`). `primary` (`compare.metric`): the metric flagged primary; a graded one (`mae`) joins the subject
    metrics. `test_folds`: subject -> the fold that tested it, for CVs whose pooled videos carry no `fold` column.

    Holm's correction runs over the primary metric's tests alone, one a pair (`p_holm`); the secondary metrics are
    reported beside them, uncorrected (`family` says which), and a secondary metric whose every per-subject number is
    the primary's (balanced accuracy at the threshold on a binary task whose subjects' videos are balanced) is not
    tested a second time."""
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
    return pd.DataFrame(intervals, columns=SUBJECT_COLUMNS), scores, paired_table(videos, primary, test_folds)


def paired_table(videos: Mapping[str, pd.DataFrame], primary: str = PRIMARY_METRIC,
                 test_folds: Mapping[str, int] | None = None, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Per pair of models and metric (every subject metric, or `metrics`): the paired test over the subjects both
    have (`pair_row`), Holm-adjusted over the primary metric's tests (`corrected`): `subject_tables`' third table,
    and what `make power` applies to each simulated study."""
    graded = primary in GRADED_SUBJECT_METRICS
    metrics = tuple(metrics or ((*SUBJECT_METRICS, *GRADED_SUBJECT_METRICS) if graded else SUBJECT_METRICS))
    by_seed = {model: seed_scores(table, graded, auroc="within_subject_auroc" in metrics)
               for model, table in videos.items()}
    units = pairing_units(videos, test_folds)
    repeats = repeated_metrics(pd.concat(by_seed.values(), ignore_index=True), metrics, primary)
    rows = [pair_row(by_seed, model_a, model_b, metric, units, primary, repeats)
            for model_a, model_b in combinations(sorted(videos), 2) for metric in metrics]
    return corrected(pd.DataFrame(rows))


def corrected(paired: pd.DataFrame) -> pd.DataFrame:
    """The paired rows with Holm's adjustment over the primary tests (one a pair; NaN elsewhere) and each test's
    minimum detectable effect: the primary's at Holm's strictest level (its first step, alpha / pairs), a
    secondary's at alpha (uncorrected)."""
    paired = paired.reindex(columns=SUBJECT_PAIRED_COLUMNS)
    if paired.empty:
        return paired
    is_primary = paired["primary"].astype(bool)
    paired["p_holm"] = np.nan
    paired.loc[is_primary, "p_holm"] = holm(paired.loc[is_primary, "p_value"].to_numpy(dtype=float))
    first_step = FAMILY_ALPHA / max(1, int(paired.loc[is_primary, "p_value"].notna().sum()))
    paired["mde80"] = [minimum_detectable_effect(row.standard_error, row.df, first_step if row.primary
                                                 else FAMILY_ALPHA, MDE_POWER) for row in paired.itertuples()]
    return paired


def pairing_units(videos: Mapping[str, pd.DataFrame],
                  test_folds: Mapping[str, int] | None = None) -> tuple[pd.Series, str]:
    """Per subject, the unit its differences are grouped in, and what a unit is in words (the table's `unit` column,
    the comparison run's tag): the fold that tested it (the pooled videos' `fold` column, else `test_folds`), whose
    trained models scored all of that fold's test subjects. With a single fold (a hold-out) or folds unknown, every
    subject is a unit of its own and the trained models are taken as fixed, which the words say."""
    folds: dict[str, int] = {}
    for table in videos.values():
        if "fold" in table.columns:
            folds.update(table.drop_duplicates("subject_name").set_index("subject_name")["fold"].astype(int))
    subjects = sorted({s for table in videos.values() for s in table["subject_name"].unique()})
    known = {s: folds.get(s, (test_folds or {}).get(s)) for s in subjects}
    if any(fold is None for fold in known.values()) or len(set(known.values())) < 2:
        return (pd.Series(subjects, index=subjects, dtype=object),
                f"{SUBJECT_UNIT} ({'one fold' if known and None not in known.values() else 'folds unknown'}: the "
                f"trained models taken as fixed, their training noise not in the test)")
    n = len(set(known.values()))
    return (pd.Series(known, dtype=object),
            f"{FOLD_UNIT} ({n} folds" + (", one subject each" if n == len(known) else
                                        ": each fold's test subjects share its trained models") + ")")


def repeated_metrics(scores: pd.DataFrame, metrics: Sequence[str], primary: str) -> dict[str, str]:
    """Metric -> the metric (the primary first, then in order) whose per-subject numbers it repeats on every subject
    of every model: one number under two names (balanced accuracy and accuracy at the threshold where every subject's
    videos are balanced between two classes), tested once."""
    kept: list[str] = []
    repeats: dict[str, str] = {}
    for metric in (primary, *(m for m in metrics if m != primary)):
        values = scores[metric].to_numpy(dtype=float)
        same = next((k for k in kept if np.allclose(values, scores[k].to_numpy(dtype=float), rtol=0, atol=1e-12,
                                                    equal_nan=True)), None)
        if same is None:
            kept.append(metric)
        else:
            repeats[metric] = same
    return repeats


def pair_row(by_seed: Mapping[str, pd.DataFrame], model_a: str, model_b: str, metric: str,
             units: tuple[pd.Series, str], primary: str, repeats: Mapping[str, str]) -> dict:
    """One pair's paired test on one metric (`statistics.paired_test`): each subject's score averaged over the
    training seeds, the differences grouped by `units`; the test, its interval and its degrees of freedom."""
    a, b = (by_seed[m].pivot(index="subject_name", columns="seed", values=metric).mean(axis=1) for m in (model_a,
                                                                                                       model_b))
    both = a.dropna().index.intersection(b.dropna().index)
    test = paired_test((a[both] - b[both]).to_numpy(), units[0].reindex(both).to_numpy())
    family = ("primary: Holm over the pairs" if metric == primary else
              f"not tested: on every subject the same number as {repeats[metric]}" if metric in repeats else
              "secondary: not corrected")
    shown = (lambda value: value) if metric not in repeats else (lambda value: np.nan)  # tested once, as the other
    return {"metric": metric, "model_a": model_a, "model_b": model_b, "n_subjects": test.n_subjects,
            "unit": units[1], "n_units": test.n_units, "mean_diff": test.mean_diff,
            "diff_ci95_low": shown(test.ci95_low), "diff_ci95_high": shown(test.ci95_high),
            "p_value": shown(test.p_value), "primary": metric == primary, "family": family,
            "standard_error": shown(test.standard_error), "df": test.df}


def seed_scores(videos: pd.DataFrame, graded: bool = False, auroc: bool = True) -> pd.DataFrame:
    """The subject metrics per subject and training seed (one seed, 0, for a CV without `cv.seeds`); `graded`: with
    each subject's MAE over levels too; without `auroc`, no within-subject AUROC (NaN)."""
    class_names = [column.removeprefix("prob_") for column in videos.columns if column.startswith("prob_")]
    if "seed" not in videos.columns:
        videos = videos.assign(seed=0)
    parts = []
    for seed, part in videos.groupby("seed", sort=True):
        scores = subject_scores(part.drop(columns="seed"), class_names, auroc)
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
