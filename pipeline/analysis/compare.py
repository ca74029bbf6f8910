"""Compare backbones on the same folds: per-fold scores from finished MLflow CV runs, summaries, paired tests, plots.

Backbones are only comparable when their cross-validations used the very same fold file, so runs whose
`fold_file_sha256` tags differ are refused rather than compared. Folds are described (mean and sd over folds, the
paired differences) but not tested: they share training subjects, and five of them cannot reach p < 0.05 in an
exact signed-rank test. The tests pair subjects instead (`pipeline.evaluation.statistics`): every tested subject is
tested once, so each backbone has one score per subject from its pooled test videos; intervals are subject bootstraps
(over subjects and seeds for the paired differences of CVs with `cv.seeds`), p-values come from a within-subject
permutation test, Holm-adjusted over every pair and metric (the family is printed; the primary metric is
`accuracy_at_threshold`). CVs that differ in how they decide, aggregate or sample, or that are incomplete, are
refused (`check_comparable`).

A personalised CV (`personalise.mode`: subject_normalised, baseline) is a protocol of its own: set against a plain
one it is refused, naming `personalise.mode`, unless `compare.allow_differences=[personalise]`; then every CV is
paired on the videos all of them tested (`statistics.common_videos`: a baseline CV's reference recordings left its
test set, so they are left out of both), and what each CV dropped is printed and logged (`_common_videos.csv`). An
ordinal or regression output is part of a CV's label (`cv_runs.cv_label`), so softmax and ordinal CVs of one
backbone are compared with each other as two labels.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, LogLocator, MaxNLocator, NullFormatter
from mlflow import MlflowClient
from mlflow.entities import Run, RunStatus

from pipeline.evaluation.graded import decided_levels, graded_metrics
from pipeline.evaluation.metrics import plot_reliability
from pipeline.evaluation.statistics import (
    CALIBRATION_METRICS,
    SUBJECT_METRICS,
    calibration_intervals,
    common_videos,
    decided_by,
    holm,
    minimum_detectable_effect,
    paired_permutation_test,
    seed_aware_difference_interval,
    smallest_signed_rank_p,
    subject_intervals,
    subject_scores,
)
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.atomic_io import atomic_write_csv, save_png
from pipeline.utils.paths import resolve_path

logger = logging.getLogger(__name__)
VERSUS_UNTUNED = "versus_untuned"  # `make compare TUNED=versus_untuned`: tuned CVs beside their untuned twins

FOLD_FILE_TAG = tracking.FOLD_FILE_TAG
DEFAULT_METRICS: tuple[str, ...] = (
    "test/video_accuracy_at_threshold",
    "test/video_balanced_accuracy_at_threshold",
    "test/video_auroc",
    "test/video_accuracy",
    "test/video_balanced_accuracy",
    "test/video_f1",
    "test/frame_auroc",
    "test/frame_accuracy",
    "test/frame_balanced_accuracy",
    "test/frame_f1",
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
POOLED_VIDEOS = "predictions_videos_all_folds.csv"  # a CV's pooled test videos (runs.orchestration.cross_validation)


class ComparisonError(RuntimeError):
    """The finished runs cannot be compared (too few backbones, different folds, missing experiment)."""


def fold_scores(client: MlflowClient, parent_run: Run, metrics: Sequence[str],
                label: str | None = None) -> pd.DataFrame:
    """One row per fold of a CV (its FINISHED child runs): fold, model, then each metric (NaN where not logged).
    `model` is `label` (the CV's name in the comparison, `cv_runs.cv_label`: backbone, strategy, weights), else the
    parent's backbone tag.

    If a fold was rerun under the same parent, its most recently started finished child counts; a CV over several
    training seeds gives each fold's mean over its seeds.
    """
    parent_id = parent_run.info.run_id
    model = label or parent_run.data.tags.get("model", "")
    children = tracking.fold_runs(client, parent_id)
    rows: dict[tuple[int, str], dict] = {}
    for child in sorted(children, key=lambda r: r.info.start_time or 0, reverse=True):
        if child.info.status != RunStatus.to_string(RunStatus.FINISHED):
            continue
        fold_tag = child.data.tags.get("fold")
        try:
            fold = int(fold_tag)
        except (TypeError, ValueError):
            raise ComparisonError(
                f"fold run {child.info.run_id} of CV {parent_id} ({model}) has fold tag {fold_tag!r}, not an integer"
            ) from None
        # a CV over several training seeds (cv.seeds) has one child per fold and seed
        seed = child.data.tags.get(tracking.SEED_TAG, "")
        if (fold, seed) in rows:
            logger.warning("CV %s (%s) has several finished runs for fold %d; using the latest", parent_id, model, fold)
            continue
        rows[(fold, seed)] = {metric: float(child.data.metrics.get(metric, np.nan)) for metric in metrics}
    table = pd.DataFrame([{"fold": fold, **values} for (fold, _), values in rows.items()],
                         columns=["fold", *metrics])
    table = table.groupby("fold", sort=True).mean().reset_index()  # each fold's mean over its seeds
    table.insert(1, "model", model)
    return table.astype({"fold": int})[["fold", "model", *metrics]]


def check_same_folds(runs: Mapping[str, Run]) -> None:
    """Refuse to compare CVs whose fold files differ (or are unrecorded): their test subjects are not the same."""
    hashes = {model: run.data.tags.get(FOLD_FILE_TAG) for model, run in runs.items()}
    if any(value is None for value in hashes.values()) or len(set(hashes.values())) > 1:
        listing = "; ".join(f"{model}: {value or '<not recorded>'}" for model, value in sorted(hashes.items()))
        raise ComparisonError(f"refusing to compare CVs run on different fold files ({FOLD_FILE_TAG}): {listing}")


# What must be equal for two CVs to be compared: identity tags of the parent run, and logged parameters (how the
# test videos are decided, aggregated and sampled; which training seeds). A parameter that a run does not hold is
# "(not set)": `cv.seeds` is only logged where several seeds were asked for.
SAME_TAGS = ("dataset", "task", "protocol", "subject_set", FOLD_FILE_TAG)
SAME_PARAMS = ("eval.threshold", "cv.seeds", "trainer.aggregation", "trainer.topk", "loader.frames_per_video",
               "loader.from_s", "personalise.mode", "personalise.k")
NOT_SET = "(not set)"
PERSONALISE = "personalise"  # compare.allow_differences=[personalise] allows every personalise.* key


def is_allowed(key: str, allowed: Sequence[str]) -> bool:
    """Whether a compared setting may differ: named itself, or its section named (`personalise` for
    `personalise.mode` and `personalise.k`)."""
    return key in allowed or key.split(".", 1)[0] in allowed


def comparability_problems(runs: Mapping[str, Run | cv_runs.CvSettings], allow_incomplete: bool = False,
                           allowed: Sequence[str] = ()) -> list[str]:
    """Every setting in which these CVs differ (SAME_TAGS, SAME_PARAMS), each with every run's value, and the
    incomplete CVs unless `allow_incomplete`. Settings in `allowed` are not problems (a reader's explicit choice).
    A CV is its finished run, or the settings a CV of a config would log (`cv_runs.planned_settings`): the same check
    tells whether CVs not yet run will be comparable."""
    settings = {label: cv if isinstance(cv, cv_runs.CvSettings) else cv_runs.CvSettings(cv.data.tags, cv.data.params)
                for label, cv in runs.items()}
    problems = []
    for source, keys in (("tags", SAME_TAGS), ("params", SAME_PARAMS)):
        for key in keys:
            if is_allowed(key, allowed):
                continue
            values = {model: getattr(cv, source).get(key, NOT_SET) for model, cv in settings.items()}
            if len(set(values.values())) > 1:
                listing = "; ".join(f"{model}: {value}" for model, value in sorted(values.items()))
                problems.append(f"{key} differs ({listing})")
    incomplete = sorted(model for model, cv in settings.items() if cv.tags.get("complete", "true") != "true")
    if incomplete and not allow_incomplete:
        problems.append("incomplete CVs (some folds or limited batches: complete=false): " + ", ".join(incomplete)
                        + "; ARGS=\"compare.allow_incomplete=true\" compares them as a smoke test, marked as one")
    return problems


def check_comparable(runs: Mapping[str, Run], allow_incomplete: bool = False, allowed: Sequence[str] = ()) -> None:
    """Refuse CVs that differ in a setting that changes what is measured, naming the setting and the values."""
    check_same_folds(runs)
    problems = comparability_problems(runs, allow_incomplete, allowed)
    if problems:
        raise ComparisonError("refusing to compare CVs that are not comparable: " + " | ".join(problems))


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


def pooled_videos(client: MlflowClient, run: Run) -> pd.DataFrame | None:
    """A CV's pooled test videos (one row per video, every subject once), or None for a run without them."""
    names = {item.path for item in client.list_artifacts(run.info.run_id)}
    if POOLED_VIDEOS not in names:
        return None
    return pd.read_csv(client.download_artifacts(run.info.run_id, POOLED_VIDEOS))


def check_primary(primary: str) -> str:
    """`compare.metric`, the primary metric of the paired tests: one of PRIMARY_CHOICES, else an error listing them."""
    if primary not in PRIMARY_CHOICES:
        raise ComparisonError(f"compare.metric={primary!r}: expected one of {', '.join(PRIMARY_CHOICES)}")
    return primary


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


def correction_family(paired: pd.DataFrame) -> str:
    """The family Holm's correction runs over, in words."""
    pairs = paired[["model_a", "model_b"]].drop_duplicates()
    metrics = list(dict.fromkeys(paired["metric"]))
    primary = next(iter(paired.loc[paired["primary"], "metric"]), PRIMARY_METRIC)
    return (f"Holm over {len(paired)} tests: {len(pairs)} pair(s) of backbones ("
            + ", ".join(f"{r.model_a} - {r.model_b}" for r in pairs.itertuples()) + f") x {len(metrics)} metrics ("
            + ", ".join(metrics) + f"); primary metric: {primary} (pooled/video_{primary}), "
            f"the others secondary; mde80: the smallest true difference the test detects with {MDE_POWER:.0%} power "
            f"at Holm's first-step level {FAMILY_ALPHA} / {len(paired)}, from the observed per-subject spread")


def plot_subject_intervals(table: pd.DataFrame, path: str | Path) -> None:
    """Each subject metric per backbone: the value and its subject-bootstrap 95 % interval (inside [0, 1])."""
    metrics = list(dict.fromkeys(table["metric"]))
    figure = Figure(figsize=(4 * len(metrics), 4))
    for axes, metric in zip(np.atleast_1d(figure.subplots(1, len(metrics))), metrics, strict=True):
        rows = table[table["metric"] == metric].reset_index(drop=True)
        errors = np.vstack([rows["value"] - rows["ci95_low"], rows["ci95_high"] - rows["value"]]).clip(min=0)
        axes.errorbar(range(len(rows)), rows["value"], yerr=np.nan_to_num(errors), fmt="o", capsize=4)
        axes.set_xticks(range(len(rows)), labels=rows["model"], rotation=30)
        axes.set_xlim(-0.5, len(rows) - 0.5)
        axes.set_ylim(0, max(1.02, float(np.nanmax(rows["ci95_high"].to_numpy(dtype=float), initial=1.0)) + 0.02))
        axes.set_title(metric.replace("_", " "), fontsize=9)
        axes.grid(alpha=0.3)
    figure.suptitle("pooled test videos, 95 % subject-bootstrap intervals", fontsize=10)
    save_png(figure, path)


def plot_fold_scores(scores: pd.DataFrame, metric: str, path: str | Path) -> None:
    """Left: each backbone's score per fold (lines and markers). Right: the spread per backbone (box plot)."""
    models = sorted(scores["model"].unique())
    if not models:
        raise ValueError("no fold scores to plot")
    figure = Figure(figsize=(11, 4.5))
    folds_axes, box_axes = figure.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    spreads = []
    for model in models:
        model_scores = scores[scores["model"] == model].sort_values("fold")
        folds_axes.plot(model_scores["fold"], model_scores[metric], marker="o", label=model)
        spreads.append(model_scores[metric].dropna().to_numpy(dtype=float))
    folds_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    folds_axes.set_xlabel("fold")
    folds_axes.set_ylabel(metric)
    folds_axes.set_title(f"{metric} per fold")
    folds_axes.grid(alpha=0.3)
    folds_axes.legend(fontsize=8)
    box_axes.boxplot(spreads)
    box_axes.set_xticks(range(1, len(models) + 1), labels=models)
    box_axes.tick_params(axis="x", labelrotation=30)
    box_axes.set_title("across folds")
    box_axes.grid(alpha=0.3)
    save_png(figure, path)


COST_METRICS = ("cost/params", "cost/macs")  # recorded on a CV's parent run (pipeline.models.cost.backbone_cost)
INSPECT_METHODS = ("rollout", "gradcam")  # `make inspect`'s maps, whose region scores the parent run holds


def _optional_int(value: str | None) -> int | None:
    return None if value in (None, "", "None", "null") else int(float(value))


def cost_and_regions(runs: Mapping[str, Run], summary: pd.DataFrame, task: str,
                     metric: str = "test/video_auroc") -> pd.DataFrame:
    """Per backbone: the metric's mean and std over folds, its size and cost (parameters, MACs of one image, as the
    CV recorded them; computed from the backbone name and input size for runs that predate the record), and the
    region scores of `make inspect` (trained models, and the untrained baseline) where it has been run."""
    from pipeline.data.tasks import get_task
    from pipeline.models.cost import backbone_cost

    rows = []
    for model, run in runs.items():
        metrics, params = run.data.metrics, run.data.params
        accuracy = summary[(summary["model"] == model) & (summary["metric"] == metric)]
        row = {"model": model, f"{metric}_mean": float(accuracy["mean"].iloc[0]) if len(accuracy) else np.nan,
               f"{metric}_std": float(accuracy["std"].iloc[0]) if len(accuracy) else np.nan}
        if all(key in metrics for key in COST_METRICS):
            row.update({"params": metrics["cost/params"], "macs": metrics["cost/macs"], "cost_source": "run"})
        else:
            try:
                cost = backbone_cost(run.data.tags.get("model", model), _optional_int(params.get("model.img_size")),
                                     get_task(task).n_classes)
                row.update({"params": cost["cost/params"], "macs": cost["cost/macs"], "cost_source": "computed"})
            except (ValueError, KeyError, RuntimeError) as error:
                logger.warning("no cost for %s: %s", model, error)
                row.update({"params": np.nan, "macs": np.nan, "cost_source": "unknown"})
        for method in INSPECT_METHODS:
            for kind, prefix in (("", "inspect/"), ("untrained_", "inspect/untrained/")):
                for statistic in ("mean", "std"):
                    key = f"{prefix}{method}/region_score_{statistic}"
                    row[f"{kind}region_{method}_{statistic}"] = metrics.get(key, np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def _cost_formatter() -> EngFormatter:
    """Labels of the cost axes: 4.94e6 -> '4.94M', 3.5e8 -> '350M', 1.7e10 -> '17G' (one instance per axis)."""
    return EngFormatter(sep="")


def plot_accuracy_vs_cost(table: pd.DataFrame, metric: str, path: str | Path) -> None:
    """The metric against MACs of one image and against parameters, log scale. With `interval_*` columns (the
    subject-bootstrap interval of the pooled accuracy at the threshold) that value and its interval are drawn;
    otherwise the mean over folds, without bars (mean +- sd over folds runs past 1 and means little)."""
    with_interval = "interval_value" in table.columns and table["interval_value"].notna().any()
    value = "interval_value" if with_interval else f"{metric}_mean"
    label = ("accuracy at the validation threshold\n(pooled, 95 % subject-bootstrap CI)" if with_interval
             else f"{metric} (mean over folds)")
    figure = Figure(figsize=(10, 4))
    for axis, column, x_label in zip(figure.subplots(1, 2), ("macs", "params"),
                                     ("multiply-accumulates per image", "parameters"), strict=True):
        known = table.dropna(subset=[column, value])
        errors = None
        if with_interval:
            errors = np.nan_to_num(np.vstack([known[value] - known["interval_low"],
                                              known["interval_high"] - known[value]]).clip(min=0))
        axis.errorbar(known[column], known[value], yerr=errors, fmt="o", capsize=3)
        for _, row in known.iterrows():
            axis.annotate(row["model"], (row[column], row[value]), textcoords="offset points",
                          xytext=(5, 5), fontsize=8)
        axis.set_xscale("log")
        axis.margins(x=0.25)  # room for the labels of the outermost points
        axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.xaxis.set_major_formatter(_cost_formatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel(x_label)
        if column == "macs":  # one label for the shared quantity: a second one would run into the left axes
            axis.set_ylabel(label)
        axis.grid(alpha=0.3, which="both")
    figure.suptitle("Accuracy against cost (at each backbone's input size in its cross-validation)", fontsize=10)
    save_png(figure, path)


def _safe_name(text: str) -> str:
    """File names and MLflow keys: letters, digits, '_', '-', '.' only."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def compare(
    dataset: str,
    protocol: str,
    task: str,
    out_dir: Path,
    tracking_uri: str | None = None,
    experiment: str = tracking.DEFAULT_EXPERIMENT,
    metrics: Sequence[str] = DEFAULT_METRICS,
    subject_set: str | None = None,
    fold_file_sha256: str | None = None,
    crop_params: Mapping[str, str] | None = None,
    tuned: Mapping[str, str] | str | None = None,
    allow_incomplete: bool = False,
    allow_differences: Sequence[str] = (),
    only: Sequence[str] = (),
    primary: str = PRIMARY_METRIC,
) -> dict:
    """Compare the latest finished CV of every backbone for one dataset/protocol/task, write tables and plots.

    With `crop_params` (logged parameter -> value, see `crop_settings`), only CVs trained on crops made that way
    count: a backbone last run on another twin look, detector or alignment is not compared with the others. CVs
    that differ in a setting of SAME_TAGS or SAME_PARAMS, or are incomplete, are refused (`check_comparable`);
    `only` keeps the CVs of those labels (`cv_runs.cv_label`) and no others; a label with no CV is an error listing
    the labels there are. `allow_incomplete` makes a smoke comparison of incomplete CVs (marked: tag
    `complete=false`), and settings in `allow_differences` may differ (each is listed in the result's `differences`
    and the run's tag). `primary` (`compare.metric`): the paired tests' primary metric (`PRIMARY_CHOICES`; `mae` for
    a graded task's mean absolute error over levels).

    Writes `comparison_<dataset>_<protocol>_<task>[_<subject_set>]` `.csv` (summary), `_paired.csv`, `_folds.csv`
    and `_<metric>.png` into `out_dir`, and logs them as an MLflow run tagged `painvit.run_kind=comparison`.
    The tracking URI defaults to `pipeline.runs.store.tracking.tracking_uri(<project root>)`.
    """
    metrics = list(metrics)
    check_primary(primary)
    uri = tracking.store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ComparisonError(f"no MLflow experiment {experiment!r} at {tracking.redact_uri(uri)}")
    experiment_id = found.experiment_id
    where_cvs = (client, [experiment_id], dataset, protocol, task, subject_set, fold_file_sha256, crop_params)
    try:
        if tuned == VERSUS_UNTUNED:
            runs = tuned_against_untuned(*where_cvs)
        else:
            runs = cv_runs.latest_finished_cvs(*where_cvs, tuned)
    except ValueError as error:  # a value MLflow's filter cannot hold
        raise ComparisonError(str(error)) from None
    if only:
        missing = [label for label in only if label not in runs]
        if missing:
            raise ComparisonError(f"compare.only names {', '.join(map(repr, missing))}, which has no finished CV here; "
                                  f"the labels there are: {', '.join(map(repr, runs)) or 'none'}")
        runs = {label: runs[label] for label in only}
    budget = next((tracking.tune_budget(run) for run in runs.values() if tracking.tune_budget(run)), tuned)
    which = ("the newest tuned CVs against their untuned twins" if tuned == VERSUS_UNTUNED
             else f"tuned CVs of the search budget {budget}" if tuned else "untuned CVs")
    where = f"{which}, dataset={dataset}, protocol={protocol}, task={task}" + (
        f", subject_set={subject_set}" if subject_set else ""
    ) + (" and these crops (" + ", ".join(f"{k}={v}" for k, v in crop_params.items()) + ")" if crop_params else "")
    if len(runs) < 2:
        found_models = ", ".join(f"{model} ({run.info.run_id})" for model, run in runs.items()) or "none"
        raise ComparisonError(
            f"need finished CVs of at least 2 backbones for {where} in experiment {experiment!r}; found: {found_models}"
        )
    check_comparable(runs, allow_incomplete, allow_differences)
    differences = comparability_problems(runs, True, [key for key in (*SAME_TAGS, *SAME_PARAMS)
                                                      if not is_allowed(key, allow_differences)])
    complete = {model: run.data.tags.get("complete", "true") == "true" for model, run in runs.items()}

    scores = pd.concat([fold_scores(client, run, metrics, label) for label, run in runs.items()], ignore_index=True)
    empty = [model for model in runs if not (scores["model"] == model).any()]
    if empty:
        raise ComparisonError(f"finished CVs without any finished fold runs: {', '.join(empty)}")
    summary = summary_table(scores, metrics)
    paired = pd.concat([paired_tests(scores, metric) for metric in metrics], ignore_index=True)

    out_dir = Path(out_dir)
    stem = _safe_name("_".join(["comparison", dataset, protocol, task] + ([subject_set] if subject_set else [])))
    paths = {
        "summary": out_dir / f"{stem}.csv",
        "paired": out_dir / f"{stem}_paired.csv",
        "folds": out_dir / f"{stem}_folds.csv",
    }
    atomic_write_csv(paths["summary"], summary)
    atomic_write_csv(paths["paired"], paired)
    atomic_write_csv(paths["folds"], scores)
    videos = {model: table for model, run in runs.items() if (table := pooled_videos(client, run)) is not None}
    common = None
    if any(difference.startswith(f"{PERSONALISE}.") for difference in differences) and len(videos) >= 2:
        videos, common = common_videos(videos)  # a personalised CV tested fewer videos: pair on those all tested
        paths["common_videos"] = out_dir / f"{stem}_common_videos.csv"
        atomic_write_csv(paths["common_videos"], common)
    subjects = subject_scores_table = subject_paired = calibration = None
    if len(videos) >= 2:
        subjects, subject_scores_table, subject_paired = subject_tables(videos, primary)
        for name, table in (("subjects", subjects), ("subject_scores", subject_scores_table),
                            ("subjects_paired", subject_paired)):
            paths[name] = out_dir / f"{stem}_{name}.csv"
            atomic_write_csv(paths[name], table)
        paths["subjects_plot"] = out_dir / f"{stem}_subjects.png"
        plot_subject_intervals(subjects, paths["subjects_plot"])
    if videos:  # calibration of each backbone's pooled video probabilities, and its reliability diagram
        curves = {model: (table["label"].to_numpy(), table[[c for c in table.columns if c.startswith("prob_")]]
                          .to_numpy()) for model, table in videos.items()}
        calibration = calibration_table(client, runs, videos)
        paths["calibration"] = out_dir / f"{stem}_calibration.csv"
        atomic_write_csv(paths["calibration"], calibration)
        paths["reliability"] = out_dir / f"{stem}_reliability.png"
        plot_reliability(curves, paths["reliability"], "pooled test videos (each CV's fold models pooled): "
                         "reliability of the probabilities")
    if len(videos) == 1:
        logger.warning("only %s has pooled test videos (%s): no subject-level intervals or tests", next(iter(videos)),
                       POOLED_VIDEOS)
    plots = {metric: out_dir / f"{stem}_{_safe_name(metric.replace('/', '_'))}.png" for metric in metrics}
    for metric, plot_path in plots.items():
        plot_fold_scores(scores, metric, plot_path)
    accuracy_metric = "test/video_auroc" if "test/video_auroc" in metrics else metrics[0]
    costs = cost_and_regions(runs, summary, task, accuracy_metric)
    if subjects is not None:
        headline = subjects[subjects["metric"] == "accuracy_at_threshold"].set_index("model")
        costs["interval_value"] = costs["model"].map(headline["value"])
        costs["interval_low"] = costs["model"].map(headline["ci95_low"])
        costs["interval_high"] = costs["model"].map(headline["ci95_high"])
    paths["cost"] = out_dir / f"{stem}_cost.csv"
    atomic_write_csv(paths["cost"], costs)
    if costs["macs"].notna().any():
        paths["accuracy_vs_cost"] = out_dir / f"{stem}_accuracy_vs_cost.png"
        plot_accuracy_vs_cost(costs, accuracy_metric, paths["accuracy_vs_cost"])

    tags = {
        tracking.RUN_KIND_TAG: tracking.COMPARISON_RUN,
        "dataset": dataset,
        "protocol": protocol,
        "task": task,
        FOLD_FILE_TAG: next(iter(runs.values())).data.tags[FOLD_FILE_TAG],
    }
    if subject_set:
        tags["subject_set"] = subject_set
    budget = tracking.tune_budget(next(iter(runs.values())))  # tuned CVs: the one budget they share
    tags.update({f"{tracking.TUNE_TAG_PREFIX}{k}": v for k, v in budget.items()})
    if budget.get("scope") == "shared":
        tags[tracking.TUNE_NOTE_TAG] = "OPTIMISTIC: settings chosen by a study shared over folds"
    if subject_paired is not None and len(subject_paired):
        tags["correction_family"] = correction_family(subject_paired)[:5000]
    tags["complete"] = str(all(complete.values())).lower()  # false: a smoke comparison of incomplete CVs
    if differences:
        tags["compared_despite"] = " | ".join(differences)[:5000]
    if common is not None:
        tags["paired_on"] = common_line(common)[:5000]
    comparison_run = client.create_run(experiment_id, tags=tags, run_name=stem)
    run_id = comparison_run.info.run_id
    try:
        params = {
            "dataset": dataset,
            "protocol": protocol,
            "task": task,
            "models": ",".join(runs),
            **{f"parent_run_id.{_safe_name(model)}": run.info.run_id for model, run in runs.items()},
        }
        if subject_set:
            params["subject_set"] = subject_set
        for key, value in params.items():
            client.log_param(run_id, key, value)
        for artifact in [*paths.values(), *plots.values()]:
            client.log_artifact(run_id, str(artifact), artifact_path="comparison")
    except BaseException:
        client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FAILED))
        raise
    client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FINISHED))

    return {
        "summary": summary,
        "paired": paired,
        "folds": scores,
        "subjects": subjects,
        "subjects_paired": subject_paired,
        "paths": {**paths, "plots": plots},
        "run_id": run_id,
        "parent_run_ids": {model: run.info.run_id for model, run in runs.items()},
        "complete": complete,
        "differences": differences,
        "cost": costs,
        "calibration": calibration,
        "common_videos": common,
    }


def common_line(record: pd.DataFrame) -> str:
    """What pairing on the common videos left out, in words, from `statistics.common_videos`' record."""
    return "paired on the videos every CV tested: " + "; ".join(
        f"{row.cv}: {int(row.n_common_videos)} of its {int(row.n_videos)} tested videos ({int(row.n_dropped_videos)} "
        f"dropped)"
        for row in record.itertuples())


CALIBRATION_NOTE = "pooled over the CV's fold models, each with its own probability scale"


def calibration_table(client: MlflowClient, runs: Mapping[str, Run],
                      videos: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per CV with pooled test videos: Brier and ECE of those videos with their subject-bootstrap intervals
    (`statistics.calibration_intervals`), and beside them the mean over folds of each fold model's own
    (`test/video_brier`, `test/video_ece` of its fold runs): pooling mixes the fold models."""
    rows = []
    for model, table in videos.items():
        class_names = [column.removeprefix("prob_") for column in table.columns if column.startswith("prob_")]
        pooled = calibration_intervals(table, class_names)
        folds = fold_scores(client, runs[model], [f"test/video_{name}" for name in CALIBRATION_METRICS], model)
        row = {"model": model, "n_subjects": table["subject_name"].nunique(), "n_folds": len(folds)}
        for name in CALIBRATION_METRICS:
            row.update({name: pooled[name], f"{name}_ci95_low": pooled[f"{name}_ci95_low"],
                        f"{name}_ci95_high": pooled[f"{name}_ci95_high"],
                        f"{name}_mean_over_folds": float(folds[f"test/video_{name}"].mean())})
        rows.append({**row, "note": CALIBRATION_NOTE})
    return pd.DataFrame(rows)


def cost_lines(costs: pd.DataFrame) -> str:
    """Accuracy next to size, cost and the region score, one line per backbone."""
    def region(row: pd.Series, kind: str, method: str) -> str:
        mean, std = row[f"{kind}region_{method}_mean"], row[f"{kind}region_{method}_std"]
        return "-" if not np.isfinite(mean) else f"{mean:.2f}+-{std:.2f}"

    accuracy = next(column for column in costs.columns if column.endswith("_mean") and not column.startswith(
        ("region", "untrained")))
    width = max([16, *(len(str(label)) for label in costs["model"])])  # labels name strategy and weights too
    lines = [f"{'model':<{width}} {accuracy.removesuffix('_mean'):>20} {'params':>9} {'MACs':>9} "
             + " ".join(f"{'region ' + method:>15} {'untrained':>11}" for method in INSPECT_METHODS)]
    for _, row in costs.iterrows():
        std = row[accuracy.replace("_mean", "_std")]
        lines.append(f"{row['model']:<{width}} {row[accuracy]:>13.3f} +-{std:>5.3f} {row['params'] / 1e6:>8.2f}M "
                     f"{row['macs'] / 1e9:>8.3f}G "
                     + " ".join(f"{region(row, '', method):>15} {region(row, 'untrained_', method):>11}"
                                for method in INSPECT_METHODS))
    lines.append("region: share of the maps' mass in the action-unit regions over their share of the area (1 = a "
                 "map that ignores them; `make inspect`); MACs per image at the CV's input size")
    return "\n".join(lines)


def tuned_against_untuned(client: MlflowClient, experiment_ids: Sequence[str], dataset: str, protocol: str, task: str,
                          subject_set: str | None, fold_file_sha256: str | None,
                          crop_params: Mapping[str, str] | None) -> dict[str, Run]:
    """Each CV label's newest tuned CV (of the newest search budget) beside the newest untuned CV of the same label
    (backbone, strategy, weights, head), on the same fold file and crops: `<label>` and `<label> tuned`. A tuned CV
    without an untuned twin is left out, with a warning."""
    where = (client, experiment_ids, dataset, protocol, task, subject_set, fold_file_sha256, crop_params)
    tuned = cv_runs.latest_finished_cvs(*where, tuned="latest")
    untuned = cv_runs.latest_finished_cvs(*where)
    runs: dict[str, Run] = {}
    for label, run in tuned.items():
        if label not in untuned:
            logger.warning("tuned CV %s (%s) has no untuned twin: run `make cv` with its settings", run.info.run_id,
                           label)
            continue
        runs[label], runs[f"{label} tuned"] = untuned[label], run
    return runs


def run_compare(cfg, tuned: str | None = None) -> dict:
    """`make compare`: the latest finished cross-validation of each backbone on the config's data/protocol/task,
    fold file and crop settings; `tuned` (`--tuned=latest` or a budget, `tracking.parse_tune_budget`): tuned CVs of
    that one search budget instead of untuned ones."""
    # Only CVs on the current fold file: runs on older or other folds never enter the comparison.
    sha = cv_runs.current_fold_file_sha256(cfg)
    options = cfg.get("compare") or {}
    try:
        result = compare(cfg.data.name, cfg.protocol.name, cfg.task.name, resolve_path(cfg.reports_dir),
                         tracking_uri=cfg.mlflow.tracking_uri, experiment=cfg.mlflow.experiment,
                         subject_set=cfg.data.subject_set, fold_file_sha256=sha, crop_params=cv_runs.crop_settings(cfg),
                         tuned=tuned if tuned in (None, "latest", VERSUS_UNTUNED)
                         else tracking.parse_tune_budget(tuned),
                         allow_incomplete=bool(options.get("allow_incomplete", False)),
                         allow_differences=list(options.get("allow_differences") or []),
                         only=[str(label) for label in options.get("only") or []],
                         primary=str(options.get("metric") or PRIMARY_METRIC))
    except ComparisonError as error:
        raise SystemExit(f"compare: {error}") from None
    if not all(result["complete"].values()):
        print("SMOKE COMPARISON (compare.allow_incomplete=true): incomplete CVs "
              + ", ".join(model for model, done in result["complete"].items() if not done)
              + "; not numbers to publish")
    for difference in result["differences"]:
        print(f"compared although (compare.allow_differences): {difference}")
    if result["common_videos"] is not None:
        print(common_line(result["common_videos"]))
    summary = result["summary"]
    wide = summary.pivot_table(index="model", columns="metric", values="mean")
    print("mean over folds (each fold's test subjects; at_threshold: the fold's validation threshold):")
    print(wide.to_string(float_format=lambda v: f"{v:.3f}"))
    n_folds = int(result["paired"]["n_folds"].max()) if len(result["paired"]) else 0
    print(f"paired differences over folds are described, not tested: {fold_test_note(n_folds)}")
    if result["subjects"] is not None:
        print("pooled test videos, 95 % subject-bootstrap intervals:")
        print(result["subjects"].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        paired = result["subjects_paired"]
        print("paired over subjects: mean difference a - b with its 95 % interval ("
              + ", ".join(sorted(set(paired["interval"]))) + "), within-subject permutation p and p_holm:")
        print(paired.drop(columns="interval").to_string(index=False, float_format=lambda v: f"{v:.4f}"))
        print(correction_family(paired))
        for row in paired[paired["primary"]].itertuples():
            verdict = "survives" if row.p_holm < FAMILY_ALPHA else "does not survive"
            print(f"{row.model_a} - {row.model_b}: {row.metric} {row.mean_diff:+.3f} ({verdict} Holm); the smallest "
                  f"difference this test detects with {MDE_POWER:.0%} power is +-{row.mde80:.3f} "
                  f"({row.n_subjects} subjects)")
    else:
        print(f"no subject-level intervals or tests: fewer than two of these CVs logged {POOLED_VIDEOS}")
    if result["calibration"] is not None:
        print(f"calibration of the pooled test videos, 95 % subject-bootstrap intervals ({CALIBRATION_NOTE}; the "
              f"mean over folds of each fold model's own beside it):")
        print(result["calibration"].drop(columns="note").to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(cost_lines(result["cost"]))
    for name, path in result["paths"].items():
        if isinstance(path, dict):  # one plot per metric
            print(f"{name}: " + ", ".join(str(p) for p in path.values()))
        else:
            print(f"{name}: {path}")
    for model, run_id in result["parent_run_ids"].items():
        note = "" if result["complete"].get(model, True) else "  (INCOMPLETE: a smoke run on some folds only)"
        print(f"compared {model}: parent run {run_id}{note}")
    print(f"MLflow comparison run {result['run_id']}")
    return result
