"""`make table`: the BioVid benchmark table, BL1 vs PA1..PA4 and the five-class task, beside published results.

For every backbone and task it runs the cross-validation, or finds the finished one with the same settings (the
resume of `pipeline.runs.cross_validation.run_cv`), then reads the pooled test-video metrics from its parent run:
accuracy and balanced accuracy at each fold's validation threshold (argmax for five classes) and the mean
within-subject AUROC, each with its 95 % subject-bootstrap interval, beside the argmax accuracy (and macro-F1 for
five classes), and what was tested (subjects, videos, unusable subjects, skipped folds, training subjects per fold).
Published rows come from a committed file (configs/literature/, one cited result a row) and are written apart, in
two groups: comparable with the run (same task, protocol and subject count, video only, decided per video) and other
protocols; they are never mixed into this project's rows.

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
# the labels a paper prints
TASK_LABELS = {"bl1_vs_pa1": "BL1 vs PA1", "bl1_vs_pa2": "BL1 vs PA2", "bl1_vs_pa3": "BL1 vs PA3",
               "bl1_vs_pa4": "BL1 vs PA4", "five_class": "five classes"}
PROTOCOL_LABELS = {"loso": "LOSO", "kfold5": "5-fold (subject-grouped)", "kfold10": "10-fold (subject-grouped)",
                   "holdout": "hold-out", "unknown": "protocol not confirmed",
                   "participant-mixed": "split mixing participants"}
LITERATURE = PROJECT_ROOT / "configs" / "literature" / "biovid_part_a.csv"
LITERATURE_COLUMNS = ["task", "method", "authors", "year", "venue", "protocol", "subjects", "modality",
                      "decision_level", "accuracy", "read", "note"]
# column -> the parent run's metric (pooled over every test video; intervals by subject bootstrap)
METRICS = {"accuracy": "pooled/video_accuracy_at_threshold",
           "accuracy_argmax": "pooled/video_accuracy_argmax",
           "balanced_accuracy": "pooled/video_balanced_accuracy_at_threshold",
           "auroc": "pooled/within_subject_video_auroc",
           "macro_f1": "pooled/video_f1"}
LABELS = {"accuracy": "accuracy at threshold", "accuracy_argmax": "argmax accuracy",
          "balanced_accuracy": "balanced accuracy", "auroc": "AUROC within subject", "macro_f1": "macro-F1"}
# what was tested (cross_validation.tested_counts), per (backbone, task)
FACTS = {"subjects_tested": "data/subjects_tested", "videos_tested": "data/videos_tested",
         "train_subjects_min": "data/train_subjects_min", "train_subjects_max": "data/train_subjects_max"}
# the published subject count a subject set stands for; the twin's full set stands for Part A's 87 (structure only)
PUBLISHED_SUBJECTS = {"all87": 87, "responders67": 67, "all": 87}
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
    """The committed published results; a missing column, a row of another width or a row without its citation
    (authors, year, venue) is an error naming the file and line."""
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
    for number, row in enumerate(table.itertuples(), start=2):
        empty = [key for key in ("authors", "year", "venue", "protocol", "subjects", "accuracy")
                 if not str(getattr(row, key)).strip()]
        if empty:
            raise ValueError(f"{path}, line {number}: no {', '.join(empty)} (every row is one cited result)")
        try:
            float(row.accuracy)
        except ValueError:
            raise ValueError(f"{path}, line {number}: accuracy {row.accuracy!r} is not one number (a range is not "
                             f"a result)") from None
    return table[LITERATURE_COLUMNS]


def published_subjects(subject_set: str) -> int | None:
    """The published subject count a run's subject set matches; None for a set no paper used (`*_usable`)."""
    return PUBLISHED_SUBJECTS.get(subject_set)


def split_literature(literature: pd.DataFrame, tasks: Sequence[str], protocol: str,
                     subject_set: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Published rows of these tasks: (comparable, other protocols). Comparable: same task, same protocol, the
    subject count the run's subject set stands for, video only, decided per video. Everything else is shown apart."""
    rows = literature[literature["task"].isin(tasks)].reset_index(drop=True)
    subjects = published_subjects(subject_set)
    same = ((rows["protocol"] == protocol) & (rows["subjects"] == str(subjects)) & (rows["modality"] == "video")
            & (rows["decision_level"] == "video"))
    return rows[same].reset_index(drop=True), rows[~same].reset_index(drop=True)


def published_view(rows: pd.DataFrame) -> pd.DataFrame:
    """Published rows as a paper's table prints them: task, method, citation, protocol and subjects, accuracy."""
    return pd.DataFrame({
        "task": [TASK_LABELS.get(t, t) for t in rows["task"]],
        "method": rows["method"],
        "citation": [f"{r.authors}, {r.year}, {r.venue}" for r in rows.itertuples()],
        "protocol": [f"{PROTOCOL_LABELS.get(r.protocol, r.protocol)}, {r.subjects} subjects"
                     for r in rows.itertuples()],
        "modality": rows["modality"],
        "accuracy %": rows["accuracy"],
        "read in": [f"{r.read} source" + (f"; {r.note}" if r.note else "") for r in rows.itertuples()],
    }, columns=["task", "method", "citation", "protocol", "modality", "accuracy %", "read in"])


def project_row(model: str, task: str, run) -> dict:
    """One backbone on one task: the metrics and their intervals in percent, what was tested, or a note why there
    is nothing."""
    row = {"model": model, "task": task, "parent_run_id": run.info.run_id if run else "",
           "complete": run.data.tags.get("complete", "") if run else "",
           "unusable_subjects": run.data.tags.get("task_unusable_subjects", "") if run else "",
           "skipped_folds": run.data.tags.get("task_skipped_folds", "") if run else "",
           "interval": interval_kind(run)}
    for column, metric in METRICS.items():
        for suffix, name in (("", column), ("_ci95_low", f"{column}_ci95_low"), ("_ci95_high", f"{column}_ci95_high")):
            value = run.data.metrics.get(metric + suffix) if run else None
            row[name] = round(100 * value, 1) if value is not None else float("nan")
    for column, metric in FACTS.items():
        value = run.data.metrics.get(metric) if run else None
        row[column] = int(value) if value is not None else float("nan")
    return row


def interval_kind(run) -> str:
    """Which kind of interval a run's pooled metrics carry (the tag the CV writes; subjects only before it)."""
    if run is None:
        return ""
    return run.data.tags.get("interval_kind", "subject bootstrap")


def cell(row: pd.Series, column: str) -> str:
    if pd.isna(row[column]):
        return "-" if row["parent_run_id"] else "pending"
    low, high = row[f"{column}_ci95_low"], row[f"{column}_ci95_high"]
    interval = "no CI" if pd.isna(low) else f"{low:.1f}, {high:.1f}"
    return f"{row[column]:.1f} [{interval}]"


def wide_table(rows: pd.DataFrame, models: Sequence[str], tasks: Sequence[str]) -> pd.DataFrame:
    """One row per task (as a paper labels it), one column group per backbone: 'value [95 % CI]' in percent.
    Macro-F1 (without an interval) only for the five-class task."""
    table = pd.DataFrame({"task": [TASK_LABELS.get(task, task) for task in tasks]})
    for model in models:
        for column, label in LABELS.items():
            cells = []
            for task in tasks:
                match = rows[(rows["model"] == model) & (rows["task"] == task)]
                if column == "macro_f1" and task != "five_class":
                    cells.append("")
                    continue
                text = cell(match.iloc[0], column) if len(match) else "pending"
                if column == "macro_f1":
                    text = text.replace(" [no CI]", "")
                if len(match) and match.iloc[0]["complete"] == "false":
                    text += " (incomplete)"
                cells.append(text)
            table[f"{model}: {label}"] = cells
    return table


def facts_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per backbone and task: subjects and videos tested, the unusable subjects and skipped folds, and how many
    subjects each fold trained on."""
    def number(value) -> str:
        return "-" if pd.isna(value) else str(int(value))

    def trained(row) -> str:
        low, high = row["train_subjects_min"], row["train_subjects_max"]
        if pd.isna(low):
            return "-"
        return str(int(low)) if low == high else f"{int(low)}-{int(high)}"

    return pd.DataFrame([{
        "model": row["model"], "task": TASK_LABELS.get(row["task"], row["task"]),
        "subjects tested": number(row["subjects_tested"]), "videos tested": number(row["videos_tested"]),
        "unusable subjects": (f"{len(row['unusable_subjects'].split(','))}: {row['unusable_subjects']}"
                              if row["unusable_subjects"] else "0"),
        "skipped folds": row["skipped_folds"] or "none",
        "training subjects per fold": trained(row),
        "interval": row["interval"] or "-",
    } for _, row in rows.iterrows()])


def training_note(rows: pd.DataFrame, protocol: str) -> str:
    """Fewer people trained on than in papers that train a LOSO fold on all 86 others: said beside the table."""
    most = rows["train_subjects_max"].dropna()
    if not len(most):
        return "training subjects per fold: not recorded by these runs"
    text = (f"each fold trained on at most {int(most.max())} subjects: its validation subjects choose the checkpoint "
            f"and the threshold and are not trained on")
    if protocol == "loso":
        text += "; papers that train a LOSO fold on all 86 other subjects train on more people (this is conservative)"
    return text


def build_report(rows: pd.DataFrame, models: Sequence[str], tasks: Sequence[str], dataset: str, protocol: str,
                 subject_set: str, literature: pd.DataFrame | None = None) -> dict:
    """The tables of `make table` from the project rows (`project_row`): this project's numbers, what was tested,
    and the published rows split into comparable ones and other protocols."""
    literature = read_literature() if literature is None else literature
    comparable, other = split_literature(literature, tasks, protocol, subject_set)
    subjects = published_subjects(subject_set)
    matched = (f"{PROTOCOL_LABELS.get(protocol, protocol)}, {subjects} subjects, video only" if subjects
               else f"{PROTOCOL_LABELS.get(protocol, protocol)} on subject set {subject_set}, which no paper used")
    notes = [training_note(rows, protocol)]
    if not len(comparable):
        notes.append(f"no published result is comparable with this run ({matched}): the published rows below use "
                     f"other protocols, subject counts or inputs")
    if dataset == "synthetic":
        notes.append("the synthetic twin only has BioVid's structure: its numbers say nothing about BioVid, whatever "
                     "the protocol")
    kinds = sorted({kind for kind in rows.get("interval", pd.Series(dtype=str)) if kind})
    return {"ours": wide_table(rows, models, tasks), "facts": facts_table(rows), "comparable": comparable,
            "other": other, "matched": matched, "notes": notes, "interval": ", ".join(kinds) or "subject bootstrap"}


def to_markdown(table: pd.DataFrame) -> str:
    header = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    return "\n".join([header, rule] + ["| " + " | ".join(str(v) for v in row) + " |" for row in table.to_numpy()])


def plot_table(ours: pd.DataFrame, published: pd.DataFrame, title: str, path: Path) -> None:
    """The two tables as a picture: this project's on top, the published ones below on grey, each titled."""
    figure = Figure(figsize=(max(8, 2.2 * len(ours.columns)), 1.2 + 0.35 * (len(ours) + len(published) + 4)))
    top, bottom = figure.subplots(2, 1, gridspec_kw={"height_ratios": [len(ours) + 1, max(1, len(published)) + 1]})
    for axes, table, heading, colour in ((top, ours, title, "white"),
                                         (bottom, published, "published results (not this project's numbers; "
                                          "group: comparable with this run or other protocols)",
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
    report = build_report(rows, model_names, task_names, cfg.data.name, cfg.protocol.name, cfg.data.subject_set)
    ours, facts = report["ours"], report["facts"]
    comparable, other = published_view(report["comparable"]), published_view(report["other"])

    subject_set = f"subject set {cfg.data.subject_set}: {describe_subject_set(cfg.data.subject_set)}"
    title = (f"this project: {cfg.data.name}, {PROTOCOL_LABELS.get(cfg.protocol.name, cfg.protocol.name)}, "
             f"{subject_set}.\nPooled test videos, in percent, [95 % CI: {report['interval']}]; accuracy at each "
             f"fold's validation threshold (argmax for five classes) beside argmax accuracy")
    out_dir = resolve_path(cfg.reports_dir)
    stem = f"table_{cfg.data.name}_{cfg.protocol.name}_{cfg.data.subject_set}"
    if tuple(task_names) != TASKS:  # a subset never overwrites the full table
        stem += "_" + "_".join(task_names)
    if tuned:  # tuned CVs: their own table, titled so
        stem += "_tuned"
        label = "tuned in a SHARED study (OPTIMISTIC)" if scope == "shared" else "tuned per fold"
        title = title.replace("this project:", f"this project, {label} (make tune):", 1)
    paths = {"markdown": out_dir / f"{stem}.md", "csv": out_dir / f"{stem}.csv", "png": out_dir / f"{stem}.png"}
    markdown = "\n\n".join([
        f"## {title.replace(chr(10), ' ')}", to_markdown(ours), "### What was tested", to_markdown(facts),
        *(f"- {note}" for note in report["notes"]),
        f"## Published results comparable with this run ({report['matched']}; not this project's numbers; accuracy "
        f"in percent at each method's own decision rule)",
        to_markdown(comparable) if len(comparable) else "(none)",
        "## Published results under other protocols, subject counts or inputs (shown apart: not comparable)",
        to_markdown(other) if len(other) else "(none for these tasks)"])
    with atomic_path(paths["markdown"], suffix=".md") as tmp:
        Path(tmp).write_text(markdown + "\n")
    published = pd.concat([report["comparable"].assign(comparable=True), report["other"].assign(comparable=False)],
                          ignore_index=True)
    long = pd.concat([rows.assign(source="this project", protocol=cfg.protocol.name, subjects=cfg.data.subject_set,
                                  dataset=cfg.data.name),
                      published.rename(columns={"method": "model"}).assign(source="published")],
                     ignore_index=True)
    atomic_write_csv(paths["csv"], long)
    plot_table(ours, pd.concat([comparable.assign(group="comparable"), other.assign(group="other protocols")],
                               ignore_index=True), title, paths["png"])

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
    print(facts.to_string(index=False))
    for note in report["notes"]:
        print(f"- {note}")
    print(f"\npublished results comparable with this run ({report['matched']}; not this project's numbers):")
    print(comparable.to_string(index=False) if len(comparable) else "(none)")
    print("\npublished results under other protocols, subject counts or inputs (not comparable):")
    print(other.to_string(index=False) if len(other) else "(none)")
    print(f"\nused {subject_set}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    print(f"MLflow table run {run.info.run_id}")
    return {"rows": rows, "table": ours, "facts": facts, "comparable": report["comparable"], "other": report["other"],
            "published": published, "paths": paths, "run_id": run.info.run_id}
