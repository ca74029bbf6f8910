"""What a comparison's MLflow run shows (`make compare`), so that it reads in the UI without opening a file: a name the
runs table tells apart (task, protocol, the CVs compared), its result table as the run's description (the Overview
renders it as Markdown: each pair's difference with its interval, p, corrected p, `mde80`, the unit resampled, then
each CV's figures), each pair's headline figures as metrics (the runs table's columns and MLflow's own run
comparison), its plots first among its artifacts (then each metric's plot per fold, then the tables). The run lives
in an experiment of its own beside the CVs' (`ui_pages.comparisons_experiment`), whose headline view shows every
pair's figures as columns.

Metric names come from the tables `compare` produces, so a column added there flows through: `<a>-<b>/<column>`
for the primary metric's test of a pair (`diff`, `diff_ci_low`, `diff_ci_high`, `p`, `p_holm`, `mde80`, `subjects`,
any other numeric column under its own name), `<a>-<b>/<metric>/<column>` for a secondary metric's, and
`<cv>/<metric>` (with `_ci_low`, `_ci_high`) for each CV's pooled subject metrics; each with four significant
digits, as a table shows them (the CSV tables among the artifacts keep every digit).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Experiment, Metric, Param, Run, RunTag

from pipeline.runs.store import tracking, ui_pages

# the paired table's columns (comparison_statistics) -> the short metric names they are logged under
PAIR_METRICS = {"mean_diff": "diff", "diff_ci95_low": "diff_ci_low", "diff_ci95_high": "diff_ci_high",
                "p_value": "p", "p_holm": "p_holm", "mde80": "mde80", "n_subjects": "subjects"}
HEADLINE_PAIR_METRICS = ("diff", "p_holm")  # a pair's columns in the comparisons' view (the others: Columns)
# what was resampled or grouped to make a pair's interval and test: the column that says it (`unit`, or `interval`
# in tables that predate it)
UNIT_COLUMNS = ("unit", "interval")
# the overview plots in the order the artifact tree lists them (ComparisonFiles' names): the subject intervals first
OVERVIEW_PLOTS = ("subjects_plot", "accuracy_vs_cost", "reliability")
MAX_DESCRIPTION = 8000  # MLflow's longest tag value: a longer description drops the secondary tests, then is cut


def metric_name(*parts: str) -> str:
    """An MLflow metric name from labels (letters, digits, `_ . -` kept; anything else `_`), parts joined by `/`."""
    return "/".join(re.sub(r"[^A-Za-z0-9_.-]", "_", part) for part in parts)


def pair_name(row) -> str:
    """A pair as its metrics name it: `<a>-<b>` (the difference is a - b)."""
    return f"{metric_name(str(row.model_a))}-{metric_name(str(row.model_b))}"


def comparison_name(tags: Mapping[str, str], labels: Sequence[str]) -> str:
    """The run's name: what tells comparisons apart first (task, protocol, the CVs), then the data."""
    subject_set = tags.get(tracking.SUBJECT_SET_TAG)
    data = tags[tracking.DATASET_TAG] + (f" {subject_set}" if subject_set else "")
    return f"{tags[tracking.TASK_TAG]} {tags[tracking.PROTOCOL_TAG]}: {' vs '.join(labels)} ({data})"


def shown_value(value) -> float:
    """A figure as the runs table shows it: four significant digits (the tables keep every digit)."""
    return float(f"{float(value):.4g}")


def pair_metrics(paired: pd.DataFrame | None) -> dict[str, float]:
    """Every numeric figure of every paired test as a metric (`<a>-<b>/<name>` for the primary metric's,
    `<a>-<b>/<metric>/<name>` for a secondary's); NaN left out."""
    if paired is None:
        return {}
    numeric = [column for column in paired.columns if column not in ("primary",)
               and pd.api.types.is_numeric_dtype(paired[column]) and not pd.api.types.is_bool_dtype(paired[column])]
    metrics = {}
    for row in paired.itertuples(index=False):
        stem = pair_name(row) if row.primary else f"{pair_name(row)}/{metric_name(str(row.metric))}"
        for column in numeric:
            value = getattr(row, column)
            if value is not None and np.isfinite(float(value)):
                metrics[f"{stem}/{PAIR_METRICS.get(column, metric_name(column))}"] = shown_value(value)
    return metrics


def cv_metrics(subjects: pd.DataFrame | None) -> dict[str, float]:
    """Each CV's pooled subject metrics with their intervals: `<cv>/<metric>`, `_ci_low`, `_ci_high`."""
    if subjects is None:
        return {}
    metrics = {}
    for row in subjects.itertuples(index=False):
        stem = metric_name(str(row.model), str(row.metric))
        for suffix, value in (("", row.value), ("_ci_low", row.ci95_low), ("_ci_high", row.ci95_high)):
            if np.isfinite(float(value)):
                metrics[stem + suffix] = shown_value(value)
    return metrics


def headline_columns(paired: pd.DataFrame | None) -> list[str]:
    """The comparisons' view's columns for these pairs: the primary test's headline figures of each."""
    if paired is None:
        return []
    return [ui_pages.metric_column(f"{pair_name(row)}/{name}") for row in paired[paired["primary"]].itertuples()
            for name in HEADLINE_PAIR_METRICS]


def interval_text(value: float, low: float, high: float, signed: bool = False) -> str:
    """`+0.033 [-0.050, 0.110]`; `-` for a missing value, the value alone without an interval."""
    if not np.isfinite(value):
        return "-"
    shown = f"{value:+.3f}" if signed else f"{value:.3f}"
    return shown + (f" [{low:.3f}, {high:.3f}]" if np.isfinite(low) and np.isfinite(high) else "")


def number_text(value) -> str:
    """A table cell: a p-value below 0.01 with four decimals, other numbers with three, text without `|`."""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value)).lower()
    if isinstance(value, (int, np.integer)):
        return str(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return "-" if not np.isfinite(number) else f"{number:.4f}" if abs(number) < 0.01 else f"{number:.3f}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown(table: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(number_text(value) for value in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def pairs_table(paired: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The paired tests as the description shows them, primary first: pair, metric, the difference with its
    interval, p, p_holm, mde80, subjects, then any other column of the table; a text column that holds one value
    for every row (the unit resampled, the family) is said once in a line instead."""
    shown = paired.sort_values("primary", ascending=False, kind="stable").reset_index(drop=True)
    lines = []
    table = pd.DataFrame({"pair (a - b)": [f"{r.model_a} - {r.model_b}" for r in shown.itertuples()],
                          "metric": [f"**{r.metric}**" if r.primary else str(r.metric) for r in shown.itertuples()],
                          "difference [95 % CI]": [interval_text(r.mean_diff, r.diff_ci95_low, r.diff_ci95_high, True)
                                                   for r in shown.itertuples()]})
    done = {"model_a", "model_b", "metric", "mean_diff", "diff_ci95_low", "diff_ci95_high", "primary"}
    ordered = [c for c in ("p_value", "p_holm", "mde80", "n_subjects") if c in shown.columns]
    for column in [*ordered, *(c for c in shown.columns if c not in done and c not in ordered)]:
        values = shown[column]
        if not pd.api.types.is_numeric_dtype(values) and values.nunique(dropna=False) == 1:
            lines.append(f"{'unit resampled' if column in UNIT_COLUMNS else column}: {values.iloc[0]}")
        else:
            table[PAIR_METRICS.get(column, column)] = values
    return table, lines


def cvs_table(result: Mapping, runs: Mapping[str, Run]) -> pd.DataFrame:
    """One row a CV: each pooled subject metric with its interval, the subjects, video AUROC over folds, its run."""
    rows = []
    summary = result["summary"]
    for model, run in runs.items():
        row: dict[str, object] = {"CV": model}
        tested = None
        if result["subjects"] is not None:
            for r in result["subjects"][result["subjects"]["model"] == model].itertuples():
                row[f"{r.metric} [95 % CI]"] = interval_text(r.value, r.ci95_low, r.ci95_high)
                tested = int(r.n_subjects)
        if tested is not None:
            row["subjects"] = tested
        auroc = summary[(summary["model"] == model) & (summary["metric"] == "test/video_auroc")]
        if len(auroc):
            row["video AUROC (folds)"] = f"{auroc['mean'].iloc[0]:.3f} ± {auroc['std'].iloc[0]:.3f}"
        row["parent run"] = run.info.run_id
        rows.append(row)
    return pd.DataFrame(rows)


def description(result: Mapping, runs: Mapping[str, Run], tags: Mapping[str, str], name: str,
                plots: Sequence[str]) -> str:
    """The run's description (Markdown): what was compared, the pairs' tests, each CV's figures, the plots."""
    parts = [f"### Comparison: {name}"]
    if not all(result["complete"].values()):
        parts.append("**SMOKE COMPARISON of incomplete CVs (compare.allow_incomplete=true): not numbers to publish**")
    parts += [f"compared although (compare.allow_differences): {d}" for d in result["differences"]]
    paired = result["subjects_paired"]
    if paired is not None and len(paired):
        table, lines = pairs_table(paired)
        parts += ["Paired tests over subjects (pooled test videos; the primary metric in bold):",
                  markdown(table), *lines]
    else:
        parts.append("No paired tests over subjects: fewer than two of these CVs logged their pooled test videos.")
    parts += [f"{key}: {tags[key]}" for key in (tracking.CORRECTION_FAMILY_TAG, tracking.PAIRED_ON_TAG) if key in tags]
    parts += ["Each CV (95 % subject-bootstrap intervals of the pooled test videos; video AUROC: mean ± sd over "
              "folds):",
              markdown(cvs_table(result, runs))]
    parts.append("Artifacts: the plots first (" + ", ".join(f"`{plot}`" for plot in plots)
                 + "), then each metric's scores per fold (`plot_folds_<metric>.png`) and every table "
                 "(`table_<name>.csv`, every digit).")
    return "\n\n".join(parts)


def artifacts(result: Mapping) -> dict[str, Path]:
    """Every file the comparison wrote, under the name the run keeps it by, so that the UI's artifact tree (which
    sorts by name) lists the plots first and the tables after them: `plot_<n>_<name>.png` for the overview plots
    (OVERVIEW_PLOTS first), `plot_folds_<metric>.png` for each metric's scores per fold, `table_<name>.csv`."""
    files = {name: Path(path) for name, path in result["paths"].items() if not isinstance(path, Mapping)}
    plots = sorted((name for name, path in files.items() if path.suffix == ".png"),
                   key=lambda name: (OVERVIEW_PLOTS.index(name) if name in OVERVIEW_PLOTS else len(OVERVIEW_PLOTS)))
    named = {f"plot_{rank}_{name.removesuffix('_plot')}.png": files[name] for rank, name in enumerate(plots, 1)}
    named.update({f"plot_folds_{metric_name(metric).replace('/', '_')}.png": Path(path)
                  for metric, path in result["paths"]["plots"].items()})
    named.update({f"table_{name}{path.suffix}": path for name, path in files.items() if path.suffix != ".png"})
    return named


def log_comparison(client: MlflowClient, cv_experiment: Experiment, runs: Mapping[str, Run], result: Mapping,
                   tags: Mapping[str, str]) -> str:
    """The comparison's MLflow run in the comparisons' experiment beside `cv_experiment`: its name, tags, the
    compared CVs as params, the figures as metrics, its description and files; the experiment's headline view grown
    by its pairs' columns. FINISHED, or FAILED when logging fails (`tracking.run_lifecycle`). Returns its id."""
    experiment_id = tracking.get_or_create_experiment(ui_pages.comparisons_experiment(cv_experiment.name),
                                                      cv_experiment.artifact_location, client)
    name = comparison_name(tags, sorted(runs))
    run_id = client.create_run(experiment_id, tags=dict(tags), run_name=name).info.run_id
    with tracking.run_lifecycle(run_id, client):
        params = {key: tags[key] for key in (tracking.DATASET_TAG, tracking.PROTOCOL_TAG, tracking.TASK_TAG,
                                             tracking.SUBJECT_SET_TAG) if key in tags}
        params.update({"models": ",".join(runs),
                       **{f"parent_run_id.{metric_name(model)}": run.info.run_id for model, run in runs.items()}})
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, 0) for k, v in {**pair_metrics(result["subjects_paired"]),
                                                    **cv_metrics(result["subjects"])}.items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics a batch
            client.log_batch(run_id, metrics=metrics[start:start + 1000])
        named = artifacts(result)
        with tempfile.TemporaryDirectory() as folder:
            for artifact, path in named.items():
                shutil.copyfile(path, Path(folder) / artifact)
            client.log_artifacts(run_id, folder)
        plots = [plot for plot in named if plot.endswith(".png") and not plot.startswith("plot_folds_")]
        text = description(result, runs, tags, name, plots)
        if len(text) > MAX_DESCRIPTION and result["subjects_paired"] is not None:
            primary = result["subjects_paired"][result["subjects_paired"]["primary"]]
            text = description({**result, "subjects_paired": primary}, runs, tags, name, plots)
        client.log_batch(run_id, tags=[RunTag(tracking.NOTE_TAG, text[:MAX_DESCRIPTION])])
        ui_pages.set_headline_view(client, experiment_id, headline_columns(result["subjects_paired"]), add=True)
    return run_id
