"""What a finished cross-validation reports (its `aggregate` step): the spread over folds and seeds, the metrics
pooled over every test video with subject-bootstrap intervals (at each fold's threshold, by argmax, calibration, a
graded task's levels), what was tested, the plots and tables logged on the parent run, and the table printed.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric

from pipeline.evaluation.graded import cv_graded_table, decided_levels, write_level_confusion
from pipeline.evaluation.metrics import (
    classification_metrics,
    decided_confusions,
    decided_per_subject,
    plot_confusion,
    plot_reliability,
    plot_roc,
    summarize_folds,
)
from pipeline.evaluation.statistics import calibration_intervals, subject_intervals, subject_scores
from pipeline.models.fold_result import FoldResult
from pipeline.runs.store import cv_runs, tracking, ui_pages

log = logging.getLogger(__name__)
REPORTED = ("auroc", "accuracy", "balanced_accuracy", "f1")
# At the fold's validation threshold (binary tasks): what a paper reports as accuracy, and its parts.
AT_THRESHOLD = ("accuracy_at_threshold", "balanced_accuracy_at_threshold", "sensitivity_at_threshold",
                "specificity_at_threshold")
HEADLINE = "pooled/video_accuracy_at_threshold"  # the number to set beside the BioVid literature
# A CV's headline figures under short, stable names (logged beside the long ones they copy): the runs table's columns
# in the experiment's headline view (`ui_pages.set_headline_view`, the address `make ui` prints). Name -> summary key.
HEADLINE_METRICS = {
    "video_auroc": "cv/video_auroc_mean",  # mean over folds, each fold's test subjects
    "video_auroc_sd": "cv/video_auroc_std",
    "accuracy": HEADLINE,  # every test video called at its fold's validation threshold, pooled
    "accuracy_ci_low": f"{HEADLINE}_ci95_low",  # its 95 % subject-bootstrap interval
    "accuracy_ci_high": f"{HEADLINE}_ci95_high",
    "balanced_accuracy": "pooled/video_balanced_accuracy_at_threshold",
    "balanced_accuracy_ci_low": "pooled/video_balanced_accuracy_at_threshold_ci95_low",
    "balanced_accuracy_ci_high": "pooled/video_balanced_accuracy_at_threshold_ci95_high",
    "within_subject_auroc": "pooled/within_subject_video_auroc",  # mean over subjects of one person's AUROC
    "subjects": "data/subjects_tested",
}


def calibration_line(summary: dict[str, float], n_models: int) -> str:
    """Brier and ECE of the pooled test videos with their subject-bootstrap intervals, said to mix the fold models
    (each calls its videos on its own probability scale), beside the mean and sd over folds of each fold's own."""
    def pooled(name: str) -> str:
        key = f"pooled/video_{name}"
        return (f"{summary.get(key, np.nan):.3f} [{summary.get(f'{key}_ci95_low', np.nan):.3f}, "
                f"{summary.get(f'{key}_ci95_high', np.nan):.3f}]")

    def per_fold(name: str) -> str:
        mean, sd = (summary.get(f"cv/video_{name}_{kind}", np.nan) for kind in ("mean", "std"))
        return f"{mean:.3f} +- {sd:.3f}"

    return (f"calibration, pooled test videos: Brier {pooled('brier')}, ECE {pooled('ece')} (95 % subject bootstrap; "
            f"pooling mixes the {n_models} fold models' probability scales); mean over folds of each fold's own: "
            f"Brier {per_fold('brier')}, ECE {per_fold('ece')}")


def record_precisions(client: MlflowClient, run_id: str, fold_runs: list) -> str:
    """Tag the parent with the precision(s) its folds trained in (each fold resolved `auto` on its own device);
    say so when they differ, since the folds' numbers then come from different arithmetic."""
    used = sorted({run.data.tags.get(tracking.PRECISION_TAG) or "unrecorded" for run in fold_runs})
    value = ",".join(used)
    client.set_tag(run_id, tracking.PRECISION_TAG, value)
    if len(used) > 1:
        per_fold = ", ".join(f"fold {run.data.tags.get(tracking.FOLD_TAG)}: "
                             f"{run.data.tags.get(tracking.PRECISION_TAG) or 'unrecorded'}" for run in fold_runs)
        message = f"the folds trained in different precisions ({per_fold}): their devices differed"
        log.warning(message)
        print(f"warning: {message}")
    return value


def spread_over_folds_and_seeds(results: list[FoldResult]) -> dict[str, float]:
    """`cv/<metric>_mean` and `_std` over folds (each fold's mean over its seeds); with several seeds also
    `seeds/<metric>_mean` and `_std` over seeds (each seed's mean over the folds): the spread a seed alone makes."""
    table = pd.DataFrame([{"fold": r.fold, "seed": r.seed, **{k.removeprefix("test/"): v for k, v in r.metrics.items()
                                                             if k.startswith("test/")}} for r in results])
    names = [column for column in table.columns if column not in ("fold", "seed")]
    by_fold = table.groupby("fold", sort=True)[names].mean()
    summary = {f"cv/{k}": v for k, v in summarize_folds(by_fold.to_dict("records")).items()}
    if table["seed"].nunique() > 1:
        by_seed = table.groupby("seed", sort=True)[names].mean()
        summary.update({f"seeds/{k}": v for k, v in summarize_folds(by_seed.to_dict("records")).items()})
    return summary


def log_aggregate(client: MlflowClient, run_id: str, results: list[FoldResult], class_names, fold_file: Path, *,
                  several_seeds: bool, graded: bool) -> dict[str, float]:
    """The CV's summary over `results` (tested on `fold_file`'s subjects; `several_seeds`: cv.seeds; `graded`: a
    graded task's levels too) logged onto the parent run `run_id`, with its tables and plots; returns the summary."""
    summary = spread_over_folds_and_seeds(results)
    # each video with the fold that tested it (make compare's paired tests group a fold's subjects) and its seed
    videos = pd.concat([r.video_predictions.assign(fold=r.fold, **({"seed": r.seed} if several_seeds else {}))
                        for r in results], ignore_index=True)
    frames = pd.concat([r.frame_predictions for r in results], ignore_index=True)
    prob_columns = [f"prob_{c}" for c in class_names]
    pooled_video = classification_metrics(videos["label"].to_numpy(), videos[prob_columns].to_numpy())
    pooled_frame = classification_metrics(frames["label"].to_numpy(), frames[prob_columns].to_numpy())
    summary.update({f"pooled/video_{k}": v for k, v in pooled_video.items()})
    summary.update({f"pooled/frame_{k}": v for k, v in pooled_frame.items()})
    summary.update(pooled_at_threshold(videos, class_names))
    summary.update(pooled_argmax(videos, class_names))
    # with subject-bootstrap intervals; pooled over the fold models (cv/video_brier_mean, _ece_mean: per fold)
    summary.update({f"pooled/video_{k}": v for k, v in calibration_intervals(videos, class_names).items()})
    summary.update(tested_counts(videos, fold_file, sorted({r.fold for r in results})))
    levels = graded_cv(results, class_names) if graded else None  # a graded task's MAE, kappa, ... pooled, per fold
    summary.update(levels[1] if levels else {})
    # the headline copies with four significant digits, as the runs table shows them (the long names keep every one)
    summary.update({name: float(f"{summary[key]:.4g}") for name, key in HEADLINE_METRICS.items() if key in summary})
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0) for k, v in summary.items() if np.isfinite(v)]
    for chunk in cv_runs.chunks(metrics, 500):
        client.log_batch(run_id, metrics=chunk)
    ui_pages.set_headline_view(client, client.get_run(run_id).info.experiment_id,
                               [tracking.DURATION_COLUMN, *map(ui_pages.metric_column, HEADLINE_METRICS)])

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table = pd.DataFrame([{"fold": r.fold, "run_id": r.run_id, **r.metrics, "seconds": round(r.seconds, 1)}
                              for r in results])
        table.to_csv(out / "folds_summary.csv", index=False)
        videos.to_csv(out / "predictions_videos_all_folds.csv", index=False)
        # every call as it was made (the fold's threshold), one seed at a time: no ensemble over seeds
        counts = []
        for seed, matrix in decided_confusions(videos, len(class_names)).items():
            suffix, what = ("", "") if seed is None else (f"_seed_{seed}", f", seed {seed}")
            plot_confusion(matrix, class_names, out / f"confusion_video_pooled{suffix}.png",
                           f"all test videos{what}, at each fold's decision")
            counts += [{"seed": seed, "true": class_names[t], "called": class_names[c], "videos": int(matrix[t, c])}
                       for t in range(len(class_names)) for c in range(len(class_names))]
        pd.DataFrame(counts).to_csv(out / "confusion_video_pooled.csv", index=False)
        if len(class_names) == 2 and videos["label"].nunique() == 2:
            plot_roc(videos["label"].to_numpy(), videos[prob_columns[1]].to_numpy(), out / "roc_video_pooled.png",
                     "all test videos")
        n_models = len({(r.fold, r.seed) for r in results})
        plot_reliability({f"all test videos ({n_models} fold models pooled)":
                          (videos["label"].to_numpy(), videos[prob_columns].to_numpy())},
                         out / "reliability_video_pooled.png")
        decided_per_subject(videos).to_csv(out / "accuracy_per_subject.csv", index=False)
        if levels:
            levels[0].to_csv(out / "graded_metrics.csv", index=False)
            write_level_confusion(levels[2], class_names, out, "confusion_levels_pooled",
                                  "all test videos by level, at each fold's decision")
        subject_scores(videos, class_names).to_csv(out / "scores_per_subject.csv", index=False)
        client.log_artifacts(run_id, str(out))
    return summary


def graded_cv(results: list[FoldResult], class_names) -> tuple[pd.DataFrame, dict[str, float], pd.DataFrame]:
    """A graded task's (`ordinal.graded_scoring`) metrics over every fold's test videos: the table pooled and per
    fold, the pooled metrics with subject-bootstrap intervals, the graded videos."""
    videos = pd.concat([r.video_predictions.assign(fold=r.fold) for r in results], ignore_index=True)
    table, pooled = cv_graded_table(videos, class_names)
    return table, pooled, decided_levels(videos, class_names)


def pooled_at_threshold(videos: pd.DataFrame, class_names) -> dict[str, float]:
    """Over all test videos, each called at its own fold's threshold: accuracy and balanced accuracy with their
    subject-bootstrap 95 % intervals, and the mean within-subject AUROC (one model's scores on one person)."""
    names = {"accuracy_at_threshold": "pooled/video_accuracy_at_threshold",
             "balanced_accuracy_at_threshold": "pooled/video_balanced_accuracy_at_threshold",
             "within_subject_auroc": "pooled/within_subject_video_auroc",
             "sensitivity_at_threshold": "pooled/video_sensitivity_at_threshold",
             "specificity_at_threshold": "pooled/video_specificity_at_threshold"}
    result = {}
    for key, value in subject_intervals(videos, class_names).items():
        stem = next(k for k in sorted(names, key=len, reverse=True) if key.startswith(k))
        result[names[stem] + key.removeprefix(stem)] = value
    return result


def fallback_line(results: list[FoldResult]) -> str:
    """How many folds (and seeds) fell back to a threshold of 0.5 because their validation videos could not choose
    one (`pipeline.evaluation.thresholds`); the reason is each fold run's `threshold_fallback` tag."""
    fell_back = [f"fold {r.fold}" + (f" seed {r.seed}" if r.seed is not None else "") for r in results
                 if r.metrics.get("test/threshold_fallback", 0.0) == 1.0]
    if not fell_back:
        return f"threshold fallbacks: 0 of {len(results)} folds"
    return (f"threshold fallbacks: {len(fell_back)} of {len(results)} folds called their test videos at 0.5 because "
            f"the validation scores could not choose a threshold ({', '.join(fell_back)}; the reason is each fold "
            f"run's threshold_fallback tag)")


def pooled_argmax(videos: pd.DataFrame, class_names) -> dict[str, float]:
    """Accuracy of the argmax calls (`pred`) over all test videos with its subject-bootstrap interval: what papers
    that decide by argmax report, beside the accuracy at the validation threshold."""
    values = subject_intervals(videos.drop(columns=["decision"], errors="ignore"), class_names,
                               metrics=("accuracy_at_threshold",))  # the one interval reported: seconds a CV
    return {f"pooled/video_accuracy_argmax{suffix}": values[f"accuracy_at_threshold{suffix}"]
            for suffix in ("", "_ci95_low", "_ci95_high")}


def tested_counts(videos: pd.DataFrame, fold_file: Path, folds: list[int]) -> dict[str, float]:
    """How many subjects and videos were tested (each video once, whatever the seeds), and the fewest and most
    training subjects of a fold (the fold file's `train` role; validation subjects are not trained on)."""
    counts = {"data/subjects_tested": float(videos["subject_name"].nunique()),
              "data/videos_tested": float(videos["sample_name"].nunique())}
    if fold_file.is_file():
        table = pd.read_csv(fold_file)
        train = table[(table["role"] == "train") & table["fold"].isin(folds)].groupby("fold")["subject_name"].nunique()
        if len(train):
            counts.update({"data/train_subjects_min": float(train.min()),
                           "data/train_subjects_max": float(train.max())})
    return counts


def print_table(results: list[FoldResult], summary: dict[str, float]) -> pd.DataFrame:
    """Per fold, mean and sd over folds (and seeds), pooled over all test videos (with the subject-bootstrap
    interval)."""
    several_seeds = len({r.seed for r in results}) > 1
    columns = [f"video_{m}" for m in REPORTED]
    if any("test/threshold" in r.metrics for r in results):
        columns = ["threshold", *(f"video_{m}" for m in AT_THRESHOLD[:2]), "video_accuracy_at_0.5", *columns]
    rows = {f"fold {r.fold}" + (f" seed {r.seed}" if several_seeds else ""):
            {c: r.metrics.get(f"test/{c}", np.nan) for c in columns} for r in results}
    rows["mean over folds"] = {c: summary.get(f"cv/{c}_mean", np.nan) for c in columns}
    rows["sd over folds"] = {c: summary.get(f"cv/{c}_std", np.nan) for c in columns}
    if several_seeds:
        rows["sd over seeds"] = {c: summary.get(f"seeds/{c}_std", np.nan) for c in columns}
    rows["pooled videos"] = {c: summary.get(f"pooled/{c}", np.nan) for c in columns}
    table = pd.DataFrame(rows).T
    table.columns = [c.removeprefix("video_").replace("_at_threshold", "@thr").replace("_at_0.5", "@0.5")
                     for c in columns]
    print(table.to_string(float_format=lambda v: f"{v:.3f}", na_rep="-"))
    if any("test/threshold" in r.metrics for r in results):
        print(fallback_line(results))
    if HEADLINE in summary:
        low, high = summary.get(f"{HEADLINE}_ci95_low", np.nan), summary.get(f"{HEADLINE}_ci95_high", np.nan)
        print(f"headline: video accuracy at the validation threshold, pooled over all test videos "
              f"{summary[HEADLINE]:.3f} (95 % subject-bootstrap CI {low:.3f}-{high:.3f})")
    return table
