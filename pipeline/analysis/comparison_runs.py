"""The runs a comparison reads (`make compare`): which finished CVs it takes (each label's newest, untuned, tuned of
one budget, or tuned beside its untuned twin), whether they may be compared (the same fold file and the settings that
change what is measured, `check_comparable`), and what they recorded: each fold's scores, the pooled test videos, the
backbone's size and cost and `make inspect`'s region scores.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run

from pipeline.data.tasks import get_task
from pipeline.models.cost import backbone_cost
from pipeline.runs.store import cv_runs, tracking

logger = logging.getLogger(__name__)
VERSUS_UNTUNED = "versus_untuned"  # `make compare TUNED=versus_untuned`: tuned CVs beside their untuned twins
FOLD_FILE_TAG = tracking.FOLD_FILE_TAG
POOLED_VIDEOS = "predictions_videos_all_folds.csv"  # a CV's pooled test videos (runs.orchestration.cv_summary)


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
    model = label or parent_run.data.tags.get(tracking.MODEL_TAG, "")
    children = tracking.fold_runs(client, parent_id)
    rows: dict[tuple[int, str], dict] = {}
    for child in sorted(children, key=lambda r: r.info.start_time or 0, reverse=True):
        if child.info.status != tracking.FINISHED:
            continue
        fold_tag = child.data.tags.get(tracking.FOLD_TAG)
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
SAME_TAGS = (tracking.DATASET_TAG, tracking.TASK_TAG, tracking.PROTOCOL_TAG, tracking.SUBJECT_SET_TAG, FOLD_FILE_TAG)
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
    incomplete = sorted(model for model, cv in settings.items() if not tracking.is_complete(cv.tags))
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


def pooled_videos(client: MlflowClient, run: Run) -> pd.DataFrame | None:
    """A CV's pooled test videos (one row per video, every subject once), or None for a run without them."""
    names = {item.path for item in client.list_artifacts(run.info.run_id)}
    if POOLED_VIDEOS not in names:
        return None
    return pd.read_csv(client.download_artifacts(run.info.run_id, POOLED_VIDEOS))


COST_METRICS = ("cost/params", "cost/macs")  # recorded on a CV's parent run (pipeline.models.cost.backbone_cost)
INSPECT_METHODS = ("rollout", "gradcam")  # `make inspect`'s maps, whose region scores the parent run holds


def _optional_int(value: str | None) -> int | None:
    return None if value in (None, "", "None", "null") else int(float(value))


def cost_and_regions(runs: Mapping[str, Run], summary: pd.DataFrame, task: str,
                     metric: str = "test/video_auroc") -> pd.DataFrame:
    """Per backbone: the metric's mean and std over folds, its size and cost (parameters, MACs of one image, as the
    CV recorded them; computed from the backbone name and input size for runs that predate the record), and the
    region scores of `make inspect` (trained models, and the untrained baseline) where it has been run."""
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
                cost = backbone_cost(run.data.tags.get(tracking.MODEL_TAG, model),
                                     _optional_int(params.get("model.img_size")),
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


def compared_runs(client: MlflowClient, experiment_id: str, experiment: str, dataset: str, protocol: str, task: str,
                  subject_set: str | None = None, fold_file_sha256: str | None = None,
                  crop_params: Mapping[str, str] | None = None, tuned: Mapping[str, str] | str | None = None,
                  only: Sequence[str] = ()) -> dict[str, Run]:
    """The CVs a comparison takes, by label (`cv_runs.cv_label`): each label's latest finished CV on this dataset,
    protocol, task, subject set, fold file and crops; untuned, tuned of one search budget (`tuned`), or tuned beside
    its untuned twin (`VERSUS_UNTUNED`); `only` keeps those labels and no others (a label with no CV is an error
    listing the labels there are). Fewer than two CVs is an error saying where they were looked for."""
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
    if len(runs) < 2:
        budget = next((tracking.tune_budget(run) for run in runs.values() if tracking.tune_budget(run)), tuned)
        which = ("the newest tuned CVs against their untuned twins" if tuned == VERSUS_UNTUNED
                 else f"tuned CVs of the search budget {budget}" if tuned else "untuned CVs")
        where = f"{which}, dataset={dataset}, protocol={protocol}, task={task}" + (
            f", subject_set={subject_set}" if subject_set else ""
        ) + (" and these crops (" + ", ".join(f"{k}={v}" for k, v in crop_params.items()) + ")" if crop_params else "")
        found_models = ", ".join(f"{model} ({run.info.run_id})" for model, run in runs.items()) or "none"
        raise ComparisonError(
            f"need finished CVs of at least 2 backbones for {where} in experiment {experiment!r}; found: {found_models}"
        )
    return runs


def all_fold_scores(client: MlflowClient, runs: Mapping[str, Run], metrics: Sequence[str]) -> pd.DataFrame:
    """Every compared CV's scores per fold in one table (`fold_scores`); a CV without a finished fold run is an
    error."""
    scores = pd.concat([fold_scores(client, run, metrics, label) for label, run in runs.items()], ignore_index=True)
    empty = [model for model in runs if not (scores["model"] == model).any()]
    if empty:
        raise ComparisonError(f"finished CVs without any finished fold runs: {', '.join(empty)}")
    return scores
