"""Compare backbones on the same folds: per-fold scores from finished MLflow CV runs, summaries, paired tests, plots.

Backbones are only comparable when their cross-validations used the very same fold file, so runs whose
`fold_file_sha256` tags differ are refused rather than compared. Folds are described (mean and sd over folds, the
paired differences) but not tested: they share training subjects, and five of them cannot reach p < 0.05 in an
exact signed-rank test. The tests pair subjects instead (`pipeline.evaluation.statistics`): every tested subject is
tested once, so each backbone has one score per subject from its pooled test videos, with a subject-bootstrap
interval. A pair's paired test groups the per-subject differences by the fold that tested them (a fold's test
subjects share its trained models), its p-value and interval from one t statistic over the folds; Holm's correction
runs over the primary metric's tests (`accuracy_at_threshold`, one a pair), the secondary metrics reported beside it
uncorrected (the family and the test's unit are printed, tabled and tagged). CVs that differ in how they decide,
aggregate or sample, or that are incomplete, are refused (`check_comparable`).

A personalised CV (`personalise.mode`: subject_normalised, baseline) is a protocol of its own: set against a plain
one it is refused, naming `personalise.mode`, unless `compare.allow_differences=[personalise]`; then every CV is
paired on the videos all of them tested (`statistics.common_videos`: a baseline CV's reference recordings left its
test set, so they are left out of both), and what each CV dropped is printed and logged (`_common_videos.csv`). An
ordinal or regression output is part of a CV's label (`cv_runs.cv_label`), so softmax and ordinal CVs of one
backbone are compared with each other as two labels.

This module is the driver (`compare`, `make compare`'s `run_compare`): the runs it reads and whether they may be
compared are `pipeline.analysis.comparison_runs`', its statistics `comparison_statistics`', its plots and printed
report `comparison_report`'.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run

from pipeline.analysis.comparison_record import log_comparison
from pipeline.analysis.comparison_report import (
    common_line,
    correction_family,
    plot_accuracy_vs_cost,
    plot_fold_scores,
    plot_subject_intervals,
    print_report,
)
from pipeline.analysis.comparison_runs import (
    FOLD_FILE_TAG,
    PERSONALISE,
    POOLED_VIDEOS,
    SAME_PARAMS,
    SAME_TAGS,
    VERSUS_UNTUNED,
    ComparisonError,
    all_fold_scores,
    check_comparable,
    comparability_problems,
    compared_runs,
    cost_and_regions,
    fold_scores,
    is_allowed,
    pooled_videos,
)
from pipeline.analysis.comparison_statistics import (
    PRIMARY_CHOICES,
    PRIMARY_METRIC,
    calibration_table,
    paired_tests,
    subject_tables,
    summary_table,
)
from pipeline.data.fold_files import read_folds, tested_in
from pipeline.evaluation.metrics import plot_reliability
from pipeline.evaluation.statistics import CALIBRATION_METRICS, common_videos
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.atomic_io import atomic_write_csv
from pipeline.utils.paths import resolve_path

logger = logging.getLogger(__name__)
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


def _safe_name(text: str) -> str:
    """File names and MLflow keys: letters, digits, '_', '-', '.' only."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def check_primary(primary: str) -> str:
    """`compare.metric`, the primary metric of the paired tests: one of PRIMARY_CHOICES, else an error listing them."""
    if primary not in PRIMARY_CHOICES:
        raise ComparisonError(f"compare.metric={primary!r}: expected one of {', '.join(PRIMARY_CHOICES)}")
    return primary


class ComparisonFiles:
    """What a comparison writes into `out_dir` as `<stem><suffix>`, by name, in the order written (what its run
    logs and `make compare` lists)."""

    def __init__(self, out_dir: Path, stem: str) -> None:
        self.out_dir, self.stem = Path(out_dir), stem
        self.paths: dict[str, Path] = {}

    def path(self, name: str, suffix: str) -> Path:
        self.paths[name] = self.out_dir / f"{self.stem}{suffix}"
        return self.paths[name]

    def csv(self, name: str, table: pd.DataFrame, suffix: str | None = None) -> None:
        atomic_write_csv(self.path(name, f"_{name}.csv" if suffix is None else suffix), table)


def compare(dataset: str, protocol: str, task: str, out_dir: Path, tracking_uri: str | None = None,
            experiment: str = tracking.DEFAULT_EXPERIMENT, metrics: Sequence[str] = DEFAULT_METRICS,
            subject_set: str | None = None, fold_file_sha256: str | None = None,
            crop_params: Mapping[str, str] | None = None, tuned: Mapping[str, str] | str | None = None,
            allow_incomplete: bool = False, allow_differences: Sequence[str] = (), only: Sequence[str] = (),
            primary: str = PRIMARY_METRIC, test_folds: Mapping[str, int] | None = None) -> dict:
    """Compare the latest finished CV of every backbone for one dataset/protocol/task, write tables and plots.

    With `crop_params` (logged parameter -> value, see `crop_settings`), only CVs trained on crops made that way
    count: a backbone last run on another twin look, detector or alignment is not compared with the others. CVs
    that differ in a setting of SAME_TAGS or SAME_PARAMS, or are incomplete, are refused (`check_comparable`);
    `only` keeps the CVs of those labels (`cv_runs.cv_label`) and no others; a label with no CV is an error listing
    the labels there are. `allow_incomplete` makes a smoke comparison of incomplete CVs (marked: tag
    `complete=false`), and settings in `allow_differences` may differ (each is listed in the result's `differences`
    and the run's tag). `primary` (`compare.metric`): the paired tests' primary metric (`PRIMARY_CHOICES`; `mae` for
    a graded task's mean absolute error over levels). `test_folds` (subject -> the fold that tested it, from the
    fold file): how the paired tests group subjects where a CV's pooled videos carry no `fold` column (older CVs).

    Writes `comparison_<dataset>_<protocol>_<task>[_<subject_set>]` `.csv` (summary), `_paired.csv`, `_folds.csv`
    and `_<metric>.png` into `out_dir`, and logs them as an MLflow run tagged `painvit.run_kind=comparison` in the
    comparisons' experiment beside `experiment` (`comparison_record.log_comparison`: its name, description, metrics).
    The tracking URI defaults to `pipeline.runs.store.tracking.tracking_uri(<project root>)`.
    """
    metrics = list(metrics)
    check_primary(primary)
    uri = tracking.store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ComparisonError(f"no MLflow experiment {experiment!r} at {tracking.redact_uri(uri)}")
    runs = compared_runs(client, found.experiment_id, experiment, dataset, protocol, task, subject_set,
                         fold_file_sha256, crop_params, tuned, only)
    check_comparable(runs, allow_incomplete, allow_differences)
    differences = comparability_problems(runs, True, [key for key in (*SAME_TAGS, *SAME_PARAMS)
                                                      if not is_allowed(key, allow_differences)])
    complete = {model: tracking.is_complete(run.data.tags) for model, run in runs.items()}
    scores = all_fold_scores(client, runs, metrics)
    summary = summary_table(scores, metrics)
    paired = pd.concat([paired_tests(scores, metric) for metric in metrics], ignore_index=True)
    files = ComparisonFiles(out_dir, _safe_name("_".join(["comparison", dataset, protocol, task]
                                                         + ([subject_set] if subject_set else []))))
    for name, table, suffix in (("summary", summary, ".csv"), ("paired", paired, None), ("folds", scores, None)):
        files.csv(name, table, suffix)
    videos, common = compared_videos(client, runs, differences, files)
    subjects, subject_paired = subject_level(videos, primary, files, test_folds)
    calibration = calibration_of(client, runs, videos, files)
    plots = {metric: files.out_dir / f"{files.stem}_{_safe_name(metric.replace('/', '_'))}.png" for metric in metrics}
    for metric, plot_path in plots.items():
        plot_fold_scores(scores, metric, plot_path)
    costs = costs_of(runs, summary, task, metrics, subjects, files)
    tags = comparison_tags(runs, dataset, protocol, task, subject_set, subject_paired, complete, differences, common)
    result = {"summary": summary, "paired": paired, "folds": scores, "subjects": subjects,
              "subjects_paired": subject_paired, "paths": {**files.paths, "plots": plots},
              "parent_run_ids": {model: run.info.run_id for model, run in runs.items()}, "complete": complete,
              "differences": differences, "cost": costs, "calibration": calibration, "common_videos": common}
    return {**result, "run_id": log_comparison(client, found, runs, result, tags)}


def compared_videos(client: MlflowClient, runs: Mapping[str, Run], differences: Sequence[str],
                    files: ComparisonFiles) -> tuple[dict[str, pd.DataFrame], pd.DataFrame | None]:
    """Each CV's pooled test videos (those that logged them); where CVs differ in their personalisation, only the
    videos every one of them tested, with the record of what each dropped (written as `_common_videos.csv`)."""
    videos = {model: table for model, run in runs.items() if (table := pooled_videos(client, run)) is not None}
    common = None
    if any(difference.startswith(f"{PERSONALISE}.") for difference in differences) and len(videos) >= 2:
        videos, common = common_videos(videos)  # a personalised CV tested fewer videos: pair on those all tested
        files.csv("common_videos", common)
    if len(videos) == 1:
        logger.warning("only %s has pooled test videos (%s): no subject-level intervals or tests", next(iter(videos)),
                       POOLED_VIDEOS)
    return videos, common


def subject_level(videos: Mapping[str, pd.DataFrame], primary: str, files: ComparisonFiles,
                  test_folds: Mapping[str, int] | None = None) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """With two CVs' pooled videos or more: the subject metrics with their intervals, the scores per subject and the
    paired tests over subjects (`subject_tables`), written with the intervals' plot; (None, None) otherwise."""
    if len(videos) < 2:
        return None, None
    subjects, subject_scores_table, subject_paired = subject_tables(videos, primary, test_folds)
    for name, table in (("subjects", subjects), ("subject_scores", subject_scores_table),
                        ("subjects_paired", subject_paired)):
        files.csv(name, table)
    plot_subject_intervals(subjects, files.path("subjects_plot", "_subjects.png"))
    return subjects, subject_paired


def calibration_of(client: MlflowClient, runs: Mapping[str, Run], videos: Mapping[str, pd.DataFrame],
                   files: ComparisonFiles) -> pd.DataFrame | None:
    """The calibration of each backbone's pooled video probabilities (`calibration_table`, beside the mean over
    folds of each fold model's own) and its reliability diagram; None without pooled videos."""
    if not videos:
        return None
    curves = {model: (table["label"].to_numpy(), table[[c for c in table.columns if c.startswith("prob_")]]
                      .to_numpy()) for model, table in videos.items()}
    folds = {model: fold_scores(client, runs[model], [f"test/video_{name}" for name in CALIBRATION_METRICS], model)
             for model in videos}
    calibration = calibration_table(videos, folds)
    files.csv("calibration", calibration)
    plot_reliability(curves, files.path("reliability", "_reliability.png"),
                     "pooled test videos (each CV's fold models pooled): reliability of the probabilities")
    return calibration


def costs_of(runs: Mapping[str, Run], summary: pd.DataFrame, task: str, metrics: Sequence[str],
             subjects: pd.DataFrame | None, files: ComparisonFiles) -> pd.DataFrame:
    """Accuracy beside size, cost and region scores (`cost_and_regions`), with the pooled accuracy at the threshold
    and its subject-bootstrap interval where there are subject-level tables; written, and plotted where MACs are
    known."""
    accuracy_metric = "test/video_auroc" if "test/video_auroc" in metrics else metrics[0]
    costs = cost_and_regions(runs, summary, task, accuracy_metric)
    if subjects is not None:
        headline = subjects[subjects["metric"] == "accuracy_at_threshold"].set_index("model")
        costs["interval_value"] = costs["model"].map(headline["value"])
        costs["interval_low"] = costs["model"].map(headline["ci95_low"])
        costs["interval_high"] = costs["model"].map(headline["ci95_high"])
    files.csv("cost", costs)
    if costs["macs"].notna().any():
        plot_accuracy_vs_cost(costs, accuracy_metric, files.path("accuracy_vs_cost", "_accuracy_vs_cost.png"))
    return costs


def comparison_tags(runs: Mapping[str, Run], dataset: str, protocol: str, task: str, subject_set: str | None,
                    subject_paired: pd.DataFrame | None, complete: Mapping[str, bool], differences: Sequence[str],
                    common: pd.DataFrame | None) -> dict[str, str]:
    """The comparison run's tags: what was compared, the tuning budget the CVs share, the family of tests, whether
    every CV was complete, what was compared despite a difference and what the pairing left out."""
    first = next(iter(runs.values()))
    tags = {tracking.RUN_KIND_TAG: tracking.COMPARISON_RUN, tracking.DATASET_TAG: dataset,
            tracking.PROTOCOL_TAG: protocol, tracking.TASK_TAG: task, FOLD_FILE_TAG: first.data.tags[FOLD_FILE_TAG]}
    if subject_set:
        tags[tracking.SUBJECT_SET_TAG] = subject_set
    budget = tracking.tune_budget(first)  # tuned CVs: the one budget they share
    tags.update({f"{tracking.TUNE_TAG_PREFIX}{k}": v for k, v in budget.items()})
    if budget.get("scope") == "shared":
        tags[tracking.TUNE_NOTE_TAG] = "OPTIMISTIC: settings chosen by a study shared over folds"
    if subject_paired is not None and len(subject_paired):
        tags[tracking.CORRECTION_FAMILY_TAG] = correction_family(subject_paired)[:tracking.MAX_TAG_CHARS]
        tags[tracking.TEST_UNIT_TAG] = str(subject_paired["unit"].iloc[0])[:tracking.MAX_TAG_CHARS]
    tags[tracking.COMPLETE_TAG] = str(all(complete.values())).lower()  # false: a smoke comparison of incomplete CVs
    if differences:
        tags[tracking.COMPARED_DESPITE_TAG] = " | ".join(differences)[:tracking.MAX_TAG_CHARS]
    if common is not None:
        tags[tracking.PAIRED_ON_TAG] = common_line(common)[:tracking.MAX_TAG_CHARS]
    return tags


def run_compare(cfg, tuned: str | None = None) -> dict:
    """`make compare`: the latest finished cross-validation of each backbone on the config's data/protocol/task,
    fold file and crop settings; `tuned` (`--tuned=latest` or a budget, `tracking.parse_tune_budget`): tuned CVs of
    that one search budget instead of untuned ones. Prints the report (`comparison_report.print_report`)."""
    # Only CVs on the current fold file: runs on older or other folds never enter the comparison.
    cv = cv_runs.CvConfig.from_config(cfg)
    sha = cv_runs.current_fold_file_sha256(cv)
    options = cfg.get("compare") or {}
    try:
        result = compare(cfg.data.name, cfg.protocol.name, cfg.task.name, resolve_path(cfg.reports_dir),
                         tracking_uri=cfg.mlflow.tracking_uri, experiment=cfg.mlflow.experiment,
                         subject_set=cfg.data.subject_set, fold_file_sha256=sha, crop_params=cv_runs.crop_settings(cv),
                         tuned=tuned if tuned in (None, "latest", VERSUS_UNTUNED)
                         else tracking.parse_tune_budget(tuned),
                         allow_incomplete=bool(options.get("allow_incomplete", False)),
                         allow_differences=list(options.get("allow_differences") or []),
                         only=[str(label) for label in options.get("only") or []],
                         primary=str(options.get("metric") or PRIMARY_METRIC),
                         test_folds=tested_in(read_folds(resolve_path(cfg.fold_file))) if sha else None)
    except ComparisonError as error:
        raise SystemExit(f"compare: {error}") from None
    print_report(result)
    return result
