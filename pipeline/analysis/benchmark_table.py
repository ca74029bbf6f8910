"""`make table`: the BioVid benchmark table, BL1 vs PA1..PA4 and the five-class task, beside published results.

For every backbone and task it runs the cross-validation, or finds the finished one with the same settings (the
resume of `pipeline.runs.cross_validation.run_cv`), then reads the pooled test-video metrics from its parent run:
accuracy and balanced accuracy at each fold's validation threshold (argmax for five classes) and the mean
within-subject AUROC, each with its 95 % subject-bootstrap interval. Published rows come from a committed file
(configs/literature/) and are written in a table of their own, marked as published: they are never mixed into this
project's rows.

    python -m pipeline table [key=value ...] --models="vit_b16 cvt_13" [--tasks="bl1_vs_pa4 five_class"]
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import RunStatus

from pipeline.runs import cv_runs, tracking
from pipeline.runs.cross_validation import run_cv
from pipeline.runs.tuning import run_tune
from pipeline.utils.atomic_io import atomic_path, atomic_write_csv, save_png
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT, resolve_path

log = logging.getLogger(__name__)
TASKS = ("bl1_vs_pa1", "bl1_vs_pa2", "bl1_vs_pa3", "bl1_vs_pa4", "five_class")
LITERATURE = PROJECT_ROOT / "configs" / "literature" / "biovid_part_a.csv"
LITERATURE_COLUMNS = ["task", "method", "protocol", "subjects", "input", "accuracy", "source", "source_kind"]
# column -> the parent run's metric (pooled over every test video; intervals by subject bootstrap)
METRICS = {"accuracy": "pooled/video_accuracy_at_threshold",
           "balanced_accuracy": "pooled/video_balanced_accuracy_at_threshold",
           "auroc": "pooled/within_subject_video_auroc"}
SUBJECT_SETS = {
    "all": "every participant of the synthetic twin",
    "all87": "all 87 participants of BioVid Part A",
    "responders67": "67 participants: BioVid's 87 without the 20 who showed no facial response to the heat (the "
                    "list comes from public code and papers that read BioVid, not from the licensed files: "
                    "data_manifests/README.md, pipeline.data.biovid.NON_RESPONDERS); many LOSO papers use it",
}


def describe_subject_set(name: str) -> str:
    """What a subject set holds, for the line every table prints."""
    base = name.removesuffix("_usable")
    text = SUBJECT_SETS.get(base, name)
    return text + (" (only those with face crops; the fold file's sidecar names the others)" if base != name else "")


def model_overrides(model: str) -> list[str]:
    """The config overrides that pick a backbone, as the Makefile does: its own file, or any timm model name."""
    if (PROJECT_ROOT / "configs" / "model" / f"{model}.yaml").is_file():
        return [f"model={model}"]
    return ["model=timm", f"model.name={model}"]


def read_literature(path: Path = LITERATURE) -> pd.DataFrame:
    """The committed published results; a missing column or a row of another width is an error naming the file."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    wrong = [number for number, row in enumerate(rows[1:], start=2) if len(row) != len(rows[0])]
    if wrong:
        raise ValueError(f"{path}, line {wrong[0]}: {len(rows[wrong[0] - 1])} fields where the header has "
                         f"{len(rows[0])} (quote a value that holds a comma)")
    table = pd.DataFrame(rows[1:], columns=rows[0])
    missing = [column for column in LITERATURE_COLUMNS if column not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; expected {LITERATURE_COLUMNS}")
    return table[LITERATURE_COLUMNS]


def project_row(model: str, task: str, run) -> dict:
    """One backbone on one task: the three metrics and their intervals in percent, or a note why there are none."""
    row = {"model": model, "task": task, "parent_run_id": run.info.run_id if run else "",
           "complete": run.data.tags.get("complete", "") if run else ""}
    for column, metric in METRICS.items():
        for suffix, name in (("", column), ("_ci95_low", f"{column}_ci95_low"), ("_ci95_high", f"{column}_ci95_high")):
            value = run.data.metrics.get(metric + suffix) if run else None
            row[name] = round(100 * value, 1) if value is not None else float("nan")
    return row


def cell(row: pd.Series, column: str) -> str:
    if pd.isna(row[column]):
        return "-" if row["parent_run_id"] else "pending"
    low, high = row[f"{column}_ci95_low"], row[f"{column}_ci95_high"]
    interval = "no CI" if pd.isna(low) else f"{low:.1f}, {high:.1f}"
    return f"{row[column]:.1f} [{interval}]"


def wide_table(rows: pd.DataFrame, models: Sequence[str], tasks: Sequence[str]) -> pd.DataFrame:
    """One row per task, one column group per backbone: 'value [95 % CI]' in percent."""
    labels = {"accuracy": "accuracy", "balanced_accuracy": "balanced accuracy", "auroc": "AUROC within subject"}
    table = pd.DataFrame({"task": list(tasks)})
    for model in models:
        for column, label in labels.items():
            cells = []
            for task in tasks:
                match = rows[(rows["model"] == model) & (rows["task"] == task)]
                text = cell(match.iloc[0], column) if len(match) else "pending"
                if len(match) and match.iloc[0]["complete"] == "false":
                    text += " (incomplete)"
                cells.append(text)
            table[f"{model}: {label}"] = cells
    return table


def to_markdown(table: pd.DataFrame) -> str:
    header = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    return "\n".join([header, rule] + ["| " + " | ".join(str(v) for v in row) + " |" for row in table.to_numpy()])


def plot_table(ours: pd.DataFrame, published: pd.DataFrame, title: str, path: Path) -> None:
    """The two tables as a picture: this project's on top, the published ones below on grey, each titled."""
    figure = Figure(figsize=(max(8, 2.2 * len(ours.columns)), 1.2 + 0.35 * (len(ours) + len(published) + 4)))
    top, bottom = figure.subplots(2, 1, gridspec_kw={"height_ratios": [len(ours) + 1, max(1, len(published)) + 1]})
    for axes, table, heading, colour in ((top, ours, title, "white"),
                                         (bottom, published, "published results (not this project's numbers)",
                                          "#eeeeee")):
        axes.axis("off")
        axes.set_title(heading, fontsize=9, loc="left")
        if len(table):
            drawn = axes.table(cellText=table.astype(str).to_numpy(), colLabels=list(table.columns),
                               cellColours=[[colour] * len(table.columns)] * len(table), loc="upper center")
            drawn.auto_set_font_size(False)
            drawn.set_fontsize(7)
            drawn.auto_set_column_width(list(range(len(table.columns))))
    save_png(figure, path)


def run_table(cfg, overrides: Sequence[str] = (), models: str | None = None, tasks: str | None = None,
              tuned: str | None = None, trials: str | None = None, scope: str | None = None) -> dict:
    """Run or reuse every (backbone, task) cross-validation, then write and log the table. `tuned` (any non-empty
    value): every cell is a tuned CV (`make tune`, `trials` and `scope` as its TRIALS= and SCOPE=) instead."""
    search = [f"tune.trials={trials}"] * bool(trials) + [f"tune.scope={scope}"] * bool(scope)
    model_names = (models or cfg.model.name).split()
    task_names = (tasks or " ".join(TASKS)).split()
    base = [o for o in overrides if not o.startswith(("model=", "model.name=", "task="))]
    client = MlflowClient(tracking.store_uri(cfg.mlflow.tracking_uri))
    rows = []
    for model in model_names:
        for task in task_names:
            if tuned:  # the tuned CV's identity includes its `tune` section: cv_runs.finished_cv finds that one
                run_cfg = load_config([*base, *model_overrides(model), f"task={task}", *search],
                                      groups=("tune=default",))
                print(f"== {model} on {task}, tuned ({run_cfg.tune.trials} trials, {run_cfg.tune.scope})")
                run_tune(run_cfg)
            else:
                run_cfg = load_config([*base, *model_overrides(model), f"task={task}"])
                print(f"== {model} on {task}")
                run_cv(run_cfg)
            rows.append(project_row(model, task, cv_runs.finished_cv(client, run_cfg)))
    rows = pd.DataFrame(rows)
    literature = read_literature()
    published = literature[literature["task"].isin(task_names)].reset_index(drop=True)
    ours = wide_table(rows, model_names, task_names)

    subject_set = f"subject set {cfg.data.subject_set}: {describe_subject_set(cfg.data.subject_set)}"
    title = (f"this project: {cfg.data.name}, {cfg.protocol.name}, {subject_set}.\nPooled test videos, in percent, "
             f"[95 % subject-bootstrap CI]; accuracy at each fold's validation threshold (argmax for five classes)")
    out_dir = resolve_path(cfg.reports_dir)
    stem = f"table_{cfg.data.name}_{cfg.protocol.name}_{cfg.data.subject_set}"
    if tuple(task_names) != TASKS:  # a subset never overwrites the full table
        stem += "_" + "_".join(task_names)
    if tuned:  # tuned CVs: their own table, titled so
        stem += "_tuned"
        label = "tuned in a SHARED study (OPTIMISTIC)" if scope == "shared" else "tuned per fold"
        title = title.replace("this project:", f"this project, {label} (make tune):", 1)
    paths = {"markdown": out_dir / f"{stem}.md", "csv": out_dir / f"{stem}.csv", "png": out_dir / f"{stem}.png"}
    markdown = "\n\n".join([f"## {title.replace(chr(10), ' ')}", to_markdown(ours),
                            "## Published results (from configs/literature/, not this project's numbers; "
                            "accuracy in percent at each method's own decision rule)",
                            to_markdown(published) if len(published) else "(none for these tasks)"])
    with atomic_path(paths["markdown"], suffix=".md") as tmp:
        Path(tmp).write_text(markdown + "\n")
    long = pd.concat([rows.assign(source="this project", protocol=cfg.protocol.name, subjects=cfg.data.subject_set,
                                  dataset=cfg.data.name),
                      published.rename(columns={"method": "model", "source": "reference"}).assign(source="published")],
                     ignore_index=True)
    atomic_write_csv(paths["csv"], long)
    plot_table(ours, published, title, paths["png"])

    experiment_id = tracking.get_or_create_experiment(cfg.mlflow.experiment, resolve_path(cfg.mlflow.artifact_root)
                                                      if cfg.mlflow.artifact_root else tracking.artifact_root(
                                                          PROJECT_ROOT), client=client)
    run = client.create_run(experiment_id, run_name=stem, tags={
        "painvit.run_kind": "table", "dataset": cfg.data.name, "protocol": cfg.protocol.name,
        "subject_set": cfg.data.subject_set, "subject_set_description": describe_subject_set(cfg.data.subject_set)})
    for key, value in {"models": ",".join(model_names), "tasks": ",".join(task_names),
                       **{f"parent_run_id.{r.model}.{r.task}": r.parent_run_id for r in rows.itertuples()}}.items():
        client.log_param(run.info.run_id, key, value)
    for path in paths.values():
        client.log_artifact(run.info.run_id, str(path), "table")
    client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))

    print(f"\n{title}\n{ours.to_string(index=False)}\n")
    print("published results (not this project's numbers):")
    print(published[["task", "method", "protocol", "subjects", "accuracy", "source_kind"]].to_string(index=False))
    print(f"\nused {subject_set}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    print(f"MLflow table run {run.info.run_id}")
    return {"rows": rows, "table": ours, "published": published, "paths": paths, "run_id": run.info.run_id}
