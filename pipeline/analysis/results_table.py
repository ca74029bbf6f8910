"""`make table`: the BioVid benchmark table, BL1 vs PA1..PA4 and the five-class task, beside published results.

For every backbone and task it runs the cross-validation, or finds the finished one with the same settings (the
resume of `pipeline.runs.orchestration.cross_validation.run_cv`), then reads the pooled test-video metrics from its
parent run: accuracy and balanced accuracy at each fold's validation threshold (argmax for five classes) and the mean
within-subject AUROC, each with its 95 % subject-bootstrap interval, beside the argmax accuracy (and macro-F1 for five
classes), and what was tested (subjects, videos, unusable subjects, skipped folds, training subjects per fold).
Published rows come from a committed file (configs/literature/, one cited result a row) and are written apart, in
three groups, never mixed into this project's rows: comparable with the run (a run on BioVid itself, same task and
protocol, as many subjects tested as the paper's, video only, decided per video); the same protocol shape (same task,
protocol and input, but a run that is not comparable: another dataset such as a synthetic twin, or another number
of tested subjects), listed with the reason; and other protocols. A personalised CV (`personalise=`, a protocol of
its own: a person's reference recordings given, and left out of their tests) is shown with its protocol and the
videos it tested, and no published (plain) row is ever comparable with it.

    python -m pipeline table [key=value ...] --models="vit_b16 cvt_13" [--tasks="bl1_vs_pa4 five_class"]
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from mlflow import MlflowClient

from pipeline.data.personalise import PersonaliseConfig, shown_protocol
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.orchestration.launchers import LaunchSession
from pipeline.runs.orchestration.tuning import run_tune
from pipeline.runs.store import cv_runs, tracking
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
# what was tested (cv_summary.tested_counts), per (backbone, task)
FACTS = {"subjects_tested": "data/subjects_tested", "videos_tested": "data/videos_tested",
         "train_subjects_min": "data/train_subjects_min", "train_subjects_max": "data/train_subjects_max"}
# only a run on BioVid Part A itself can be set beside BioVid papers: a twin (the 20-person one, or the BioVid-scale
# `synthetic87` under BioVid's 87 subject names) has BioVid's structure, never its people
BIOVID = "biovid"
BIOVID_SUBJECT_SETS = {"all87": "BioVid Part A's 87 participants", "responders67": "BioVid's 67 facial responders"}
GROUPS = {"comparable": "comparable", "shape": "same protocol shape (not comparable)", "other": "other protocols"}
SUBJECT_SETS = {
    "all": "every participant of the synthetic twin",
    "all87": "all 87 participants of BioVid Part A",
    "responders67": "67 participants: BioVid's 87 without the 20 who showed no facial response to the heat (the "
                    "list comes from public code and papers that read BioVid, not from the licensed files: "
                    "data_manifests/README.md, pipeline.data.biovid.NON_RESPONDERS); many LOSO papers use it",
}


def describe_subject_set(name: str, dataset: str) -> str:
    """What a subject set holds, for the line every table prints; a BioVid set of another dataset (the BioVid-scale
    twin) is said to be synthetic people under BioVid's names."""
    base = name.removesuffix("_usable")
    text = SUBJECT_SETS.get(base, name)
    if dataset != BIOVID and base in BIOVID_SUBJECT_SETS:
        text = (f"synthetic people under the subject names of {BIOVID_SUBJECT_SETS[base]} (dataset {dataset}: not "
                f"BioVid's people or videos)")
    return text + (" (only those with face crops; the fold file's sidecar names the others)" if base != name else "")


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


def tested_subjects(rows: pd.DataFrame) -> dict[str, set[int]]:
    """Per task, the subject counts this project's runs of it tested (`data/subjects_tested`: the subjects of the
    CV's pooled test videos); a pending run or one that did not record it adds -1 (never a published count)."""
    counts: dict[str, set[int]] = {}
    for row in rows.itertuples():
        value = getattr(row, "subjects_tested", float("nan"))
        counts.setdefault(row.task, set()).add(-1 if pd.isna(value) else int(value))
    return counts


def split_literature(literature: pd.DataFrame, tasks: Sequence[str], protocol: str, dataset: str,
                     tested: dict[str, set[int]],
                     personalised: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Published rows of these tasks: (comparable, same protocol shape, other protocols).

    Same shape: same task and protocol, video only, decided per video. Comparable: of the same shape, and the run is
    on BioVid (`dataset == "biovid"`) and every run of the task tested exactly the paper's number of subjects
    (`tested`, from `tested_subjects`), and no run is personalised (the papers' rows are plain protocols). A twin
    never is, whatever its subject set is named."""
    rows = literature[literature["task"].isin(tasks)].reset_index(drop=True)
    shape = ((rows["protocol"] == protocol) & (rows["modality"] == "video") & (rows["decision_level"] == "video"))
    counts_match = pd.Series([tested.get(row.task, set()) == {int(row.subjects)} if str(row.subjects).isdigit()
                              else False for row in rows.itertuples()], index=rows.index, dtype=bool)
    comparable = shape & counts_match & (dataset == BIOVID) & (not personalised)
    return (rows[comparable].reset_index(drop=True), rows[shape & ~comparable].reset_index(drop=True),
            rows[~shape].reset_index(drop=True))


def not_comparable_reason(dataset: str, tested: dict[str, set[int]], shape: pd.DataFrame,
                          personalised: Sequence[str] = ()) -> str:
    """Why the rows of the same protocol shape are not comparable: a personalised protocol, the dataset, else the
    tested subject counts."""
    if personalised:
        return (f"this run is personalised ({', '.join(personalised)}): each test person's own recordings were used "
                f"(a reference given, or their statistics), on fewer videos for a baseline; the papers' rows are "
                f"plain protocols")
    if dataset != BIOVID:
        return (f"this run is on the {dataset} dataset, not BioVid: a twin has BioVid's layout and protocol, not its "
                f"people, so no BioVid paper's number is comparable with it")
    parts = []
    for task, part in shape.groupby("task", sort=False):
        ours = ", ".join(str(n) if n >= 0 else "not recorded" for n in sorted(tested.get(task, {-1})))
        papers = ", ".join(sorted(set(part.subjects)))
        parts.append(f"{TASK_LABELS.get(task, task)}: {ours} tested, the papers {papers}")
    return f"this run tested other subject counts than the papers ({'; '.join(parts)})"


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


def project_row(model: str, task: str, run, protocol: str = "none") -> dict:
    """One backbone on one task: the metrics and their intervals in percent, what was tested, or a note why there
    is nothing. `protocol`: the personalisation protocol asked for (`PersonaliseConfig.label`); a finished run's
    own tag wins (a run without one is plain, `none`)."""
    if run is not None:
        protocol = shown_protocol(run.data.tags.get(tracking.PERSONALISE_TAG) or "none")
    row = {"model": model, "task": task, "personalise": protocol, "parent_run_id": run.info.run_id if run else "",
           "complete": str(tracking.is_complete(run.data.tags)).lower() if run else "",
           "unusable_subjects": run.data.tags.get(tracking.TASK_UNUSABLE_TAG, "") if run else "",
           "skipped_folds": run.data.tags.get(tracking.TASK_SKIPPED_FOLDS_TAG, "") if run else "",
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
    return run.data.tags.get(tracking.INTERVAL_KIND_TAG, "subject bootstrap")


def cell(row: pd.Series, column: str) -> str:
    if pd.isna(row[column]):
        return "-" if row["parent_run_id"] else "pending"
    low, high = row[f"{column}_ci95_low"], row[f"{column}_ci95_high"]
    interval = "no CI" if pd.isna(low) else f"{low:.1f}, {high:.1f}"
    return f"{row[column]:.1f} [{interval}]"


def wide_table(rows: pd.DataFrame, models: Sequence[str], tasks: Sequence[str]) -> pd.DataFrame:
    """One row per task (as a paper labels it), one column group per backbone: 'value [95 % CI]' in percent.
    Macro-F1 (without an interval) only for the five-class task."""
    table = pd.DataFrame({"task": [TASK_LABELS.get(task, task) for task in tasks],
                          "protocol": [protocol_cell(rows[rows["task"] == task]) for task in tasks]})
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


def protocol_cell(rows: pd.DataFrame) -> str:
    """The personalisation protocol of a task's rows (`none`: plain), with the videos tested for a personalised one
    (a baseline's references left the test set: fewer videos than a plain run's)."""
    cells = []
    for row in rows.itertuples():
        protocol = getattr(row, "personalise", "none") or "none"
        videos = getattr(row, "videos_tested", float("nan"))
        if protocol != "none":
            protocol += f", {'?' if pd.isna(videos) else int(videos)} videos tested"
        cells.append(protocol)
    return "; ".join(dict.fromkeys(cells)) or "none"


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
        "protocol": row.get("personalise", "none") or "none",
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
    and the published rows in three groups (`split_literature`): comparable, same protocol shape, other."""
    literature = read_literature() if literature is None else literature
    tested = tested_subjects(rows)
    personalised = sorted({str(p) for p in rows.get("personalise", pd.Series(dtype=str)) if p and p != "none"})
    comparable, shape, other = split_literature(literature, tasks, protocol, dataset, tested, bool(personalised))
    counts = sorted({n for task in tasks for n in tested.get(task, set()) if n >= 0})
    matched = (f"{dataset}, {PROTOCOL_LABELS.get(protocol, protocol)}, "
               f"{'/'.join(map(str, counts)) or 'no'} subjects tested (subject set {subject_set}), video only")
    reason = not_comparable_reason(dataset, tested, shape, personalised) if len(shape) else ""
    notes = [training_note(rows, protocol)]
    if not len(comparable):
        notes.append(f"no published result is comparable with this run ({matched}): "
                     + (reason or "the published rows below use other protocols, subject counts or inputs"))
    if len(shape):
        notes.append(f"published rows of the same protocol shape are listed apart as NOT comparable: {reason}")
    if personalised:
        notes.append(f"personalised protocol ({', '.join(personalised)}): not comparable with plain LOSO or k-fold "
                     f"numbers, ours or published; a baseline tests fewer videos (the protocol column says how many)")
    if dataset != BIOVID:
        notes.append(f"the {dataset} dataset only has BioVid's structure: its numbers say nothing about BioVid, "
                     f"whatever the protocol or subject set")
    kinds = sorted({kind for kind in rows.get("interval", pd.Series(dtype=str)) if kind})
    return {"ours": wide_table(rows, models, tasks), "facts": facts_table(rows), "comparable": comparable,
            "shape": shape, "other": other, "matched": matched, "reason": reason, "notes": notes,
            "interval": ", ".join(kinds) or "subject bootstrap"}


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
                                          "group: comparable, same protocol shape (not comparable), other protocols)",
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


@dataclass(frozen=True)
class TableOf:
    """What a results table is of: the dataset, protocol and subject set its cells share."""

    dataset: str
    protocol: str
    subject_set: str


def run_table(cfg, overrides: Sequence[str] = (), models: str | None = None, tasks: str | None = None,
              tuned: str | None = None, trials: str | None = None, scope: str | None = None) -> dict:
    """Run or reuse every (backbone, task) cross-validation, then write and log the table. `tuned` (any non-empty
    value): every cell is a tuned CV (`make tune`, `trials` and `scope` as its TRIALS= and SCOPE=) instead."""
    model_names = (models or cfg.model.name).split()
    task_names = (tasks or " ".join(TASKS)).split()
    client = MlflowClient(tracking.store_uri(cfg.mlflow.tracking_uri))
    rows = pd.DataFrame(project_rows(client, overrides, model_names, task_names, tuned, trials, scope))
    of = TableOf(str(cfg.data.name), str(cfg.protocol.name), str(cfg.data.subject_set))
    report = build_report(rows, model_names, task_names, of.dataset, of.protocol, of.subject_set)
    ours, facts = report["ours"], report["facts"]
    views = {group: published_view(report[group]) for group in GROUPS}
    title = table_title(of, report["interval"], tuned, scope)
    stem = f"table_{cfg.data.name}_{cfg.protocol.name}_{cfg.data.subject_set}"
    if tuple(task_names) != TASKS:  # a subset never overwrites the full table
        stem += "_" + "_".join(task_names)
    stem += "_tuned" if tuned else ""  # tuned CVs: their own table, titled so
    out_dir = resolve_path(cfg.reports_dir)
    paths = {"markdown": out_dir / f"{stem}.md", "csv": out_dir / f"{stem}.csv", "png": out_dir / f"{stem}.png"}
    headings = {
        "comparable": f"Published results comparable with this run ({report['matched']}; not this project's numbers; "
                      f"accuracy in percent at each method's own decision rule)",
        "shape": f"Published results of the same protocol shape, NOT comparable with this run ({report['reason']})",
        "other": "Published results under other protocols, subject counts or inputs (shown apart: not comparable)"}
    shown = [group for group in GROUPS if group != "shape" or len(views[group])]  # no empty "same shape" group
    parts = [f"## {title.replace(chr(10), ' ')}", to_markdown(ours), "### What was tested", to_markdown(facts),
             *(f"- {note}" for note in report["notes"])]
    for group in shown:
        parts += [f"## {headings[group]}", to_markdown(views[group]) if len(views[group]) else "(none)"]
    with atomic_path(paths["markdown"], suffix=".md") as tmp:
        Path(tmp).write_text("\n\n".join(parts) + "\n")
    published = pd.concat([report[group].assign(comparable=group == "comparable", group=GROUPS[group])
                           for group in GROUPS], ignore_index=True)
    long = pd.concat([rows.assign(source="this project", protocol=cfg.protocol.name, subjects=cfg.data.subject_set,
                                  dataset=cfg.data.name),
                      published.rename(columns={"method": "model"}).assign(source="published")],
                     ignore_index=True)
    atomic_write_csv(paths["csv"], long)
    plot_table(ours, pd.concat([views[group].assign(group=GROUPS[group]) for group in GROUPS], ignore_index=True),
               title, paths["png"])
    artifact_root = resolve_path(cfg.mlflow.artifact_root) if cfg.mlflow.artifact_root else tracking.artifact_root(
        PROJECT_ROOT)
    experiment_id = tracking.get_or_create_experiment(cfg.mlflow.experiment, artifact_root, client=client)
    run_id = log_table_run(client, experiment_id, of, stem, model_names, task_names, rows, paths)
    print(f"\n{title}\n{ours.to_string(index=False)}\n")
    print(facts.to_string(index=False))
    for note in report["notes"]:
        print(f"- {note}")
    for group in shown:
        print(f"\n{headings[group]}:")
        print(views[group].to_string(index=False) if len(views[group]) else "(none)")
    print(f"\nused subject set {cfg.data.subject_set}: {describe_subject_set(cfg.data.subject_set, cfg.data.name)}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    print(f"MLflow table run {run_id}")
    return {"rows": rows, "table": ours, "facts": facts, "comparable": report["comparable"], "shape": report["shape"],
            "other": report["other"], "published": published, "paths": paths, "run_id": run_id}


def project_rows(client: MlflowClient, overrides: Sequence[str], model_names: Sequence[str],
                 task_names: Sequence[str], tuned: str | None, trials: str | None, scope: str | None) -> list[dict]:
    """One row per (backbone, task): its cross-validation run or reused (`run_cv`; `make tune`'s `run_tune` for a
    tuned table, with TRIALS= and SCOPE=), then read from its finished parent run (`project_row`)."""
    search = [f"tune.trials={trials}"] * bool(trials) + [f"tune.scope={scope}"] * bool(scope)
    base = [o for o in overrides if not o.startswith(("model=", "model.name=", "task="))]
    rows = []
    with LaunchSession() as session:  # one tracking server and one set of workers for every CV of the table
        for model in model_names:
            for task in task_names:
                if tuned:  # the tuned CV's identity includes its `tune` section: cv_runs.finished_cv finds that one
                    run_cfg = load_config([*base, f"model={model}", f"task={task}", *search],
                                          groups=("tune=default",))
                    print(f"== {model} on {task}, tuned ({run_cfg.tune.trials} trials, {run_cfg.tune.scope})")
                    run_tune(run_cfg)
                else:
                    run_cfg = load_config([*base, f"model={model}", f"task={task}"])
                    print(f"== {model} on {task}")
                    run_cv(run_cfg, session)
                asked = PersonaliseConfig.from_config(run_cfg.get("personalise")).label
                finished = cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(run_cfg))
                rows.append(project_row(model, task, finished, asked))
    return rows


def table_title(of: TableOf, interval: str, tuned: str | None, scope: str | None) -> str:
    """The table's title: dataset, protocol, subject set, what the numbers are; a tuned table says how it was
    tuned (OPTIMISTIC for a shared study)."""
    subject_set = f"subject set {of.subject_set}: {describe_subject_set(of.subject_set, of.dataset)}"
    title = (f"this project: {of.dataset}, {PROTOCOL_LABELS.get(of.protocol, of.protocol)}, "
             f"{subject_set}.\nPooled test videos, in percent, [95 % CI: {interval}]; accuracy at each "
             f"fold's validation threshold (argmax for five classes) beside argmax accuracy")
    if tuned:
        label = "tuned in a SHARED study (OPTIMISTIC)" if scope == "shared" else "tuned per fold"
        title = title.replace("this project:", f"this project, {label} (make tune):", 1)
    return title


def log_table_run(client: MlflowClient, experiment_id: str, of: TableOf, stem: str, model_names: Sequence[str],
                  task_names: Sequence[str], rows: pd.DataFrame, paths: dict[str, Path]) -> str:
    """The table's MLflow run (tagged `table`) in `experiment_id`: the backbones, tasks and the parent run of each
    cell as params, the three files as artifacts; FINISHED. Returns its id."""
    run = client.create_run(experiment_id, run_name=stem, tags={
        tracking.RUN_KIND_TAG: tracking.TABLE_RUN, tracking.DATASET_TAG: of.dataset,
        tracking.PROTOCOL_TAG: of.protocol, tracking.SUBJECT_SET_TAG: of.subject_set,
        tracking.SUBJECT_SET_DESCRIPTION_TAG: describe_subject_set(of.subject_set, of.dataset)})
    with tracking.run_lifecycle(run.info.run_id, client):
        for key, value in {"models": ",".join(model_names), "tasks": ",".join(task_names),
                           **{f"parent_run_id.{r.model}.{r.task}": r.parent_run_id for r in rows.itertuples()}}.items():
            client.log_param(run.info.run_id, key, value)
        for path in paths.values():
            client.log_artifact(run.info.run_id, str(path), "table")
    return run.info.run_id
