"""How a comparison is shown (`make compare`): its plots (each backbone's score per fold, the subject-bootstrap
intervals, accuracy against cost), the family of tests in words, what pairing on common videos left out, the cost
lines, and the report `make compare` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, LogLocator, MaxNLocator, NullFormatter

from pipeline.analysis.comparison_runs import INSPECT_METHODS, POOLED_VIDEOS
from pipeline.analysis.comparison_statistics import (
    CALIBRATION_NOTE,
    FAMILY_ALPHA,
    MDE_POWER,
    PRIMARY_METRIC,
    fold_test_note,
)
from pipeline.data.personalise import TRANSDUCTIVE_LABEL
from pipeline.utils.atomic_io import save_png


def correction_family(paired: pd.DataFrame) -> str:
    """The family Holm's correction runs over, and what stands beside it uncorrected, in words."""
    primary_rows = paired[paired["primary"].astype(bool)]
    primary = next(iter(primary_rows["metric"]), PRIMARY_METRIC)
    secondary = list(dict.fromkeys(paired.loc[~paired["primary"].astype(bool), "metric"]))
    marked = paired[paired["family"].str.startswith("not tested")]  # one number under two names: tested once
    untested = dict(zip(marked["metric"], marked["family"].str.split("same number as ").str[-1], strict=True))
    reported = [m for m in secondary if m not in untested]
    unit = next(iter(paired["unit"]), "")
    return (f"Holm over {len(primary_rows)} test(s): the primary metric {primary} (pooled/video_{primary}), one test "
            f"a pair of backbones (" + ", ".join(f"{r.model_a} - {r.model_b}" for r in primary_rows.itertuples())
            + f"); each test over subjects grouped by {unit}, its p-value and interval from one t statistic"
            + (f"; secondary metrics reported beside it, NOT corrected: {', '.join(reported)}" if reported else "")
            + ("; not tested twice (on every subject the same number as another): "
               + ", ".join(f"{m} = {same}" for m, same in untested.items()) if untested else "")
            + f"; mde80: the smallest true difference the primary test detects with {MDE_POWER:.0%} power at Holm's "
            f"first-step level {FAMILY_ALPHA} / {len(primary_rows)} (a secondary's at {FAMILY_ALPHA}), from the "
            f"observed spread of its units")


def common_line(record: pd.DataFrame) -> str:
    """What pairing on the common videos left out, in words, from `statistics.common_videos`' record."""
    return "paired on the videos every CV tested: " + "; ".join(
        f"{row.cv}: {int(row.n_common_videos)} of its {int(row.n_videos)} tested videos ({int(row.n_dropped_videos)} "
        f"dropped)"
        for row in record.itertuples())


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


def print_report(result: Mapping) -> None:
    """What `make compare` prints of a comparison (`compare.compare`'s result): what it compared despite, the mean
    over folds, the subject-level tests, the calibration, the costs, the files written and the runs compared."""
    if not all(result["complete"].values()):
        print("SMOKE COMPARISON (compare.allow_incomplete=true): incomplete CVs "
              + ", ".join(model for model, done in result["complete"].items() if not done)
              + "; not numbers to publish")
    for difference in result["differences"]:
        print(f"compared although (compare.allow_differences): {difference}")
    if result["common_videos"] is not None:
        print(common_line(result["common_videos"]))
    transductive = sorted(model for model in result["parent_run_ids"] if TRANSDUCTIVE_LABEL in model)
    if transductive:
        print(f"TRANSDUCTIVE: {', '.join(transductive)} standardise(s) each test person by all of that person's test "
              f"videos, both classes in the test set's mix (the task's 50/50 unless _test1to<n>): a deployed model "
              f"never knows that mix; personalise.test_pain_share=0.2 measures it on unbalanced test people")
    wide = result["summary"].pivot_table(index="model", columns="metric", values="mean")
    print("mean over folds (each fold's test subjects; at_threshold: the fold's validation threshold):")
    print(wide.to_string(float_format=lambda v: f"{v:.3f}"))
    n_folds = int(result["paired"]["n_folds"].max()) if len(result["paired"]) else 0
    print(f"paired differences over folds are described, not tested: {fold_test_note(n_folds)}")
    print_subject_tests(result["subjects"], result["subjects_paired"])
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


def print_subject_tests(subjects: pd.DataFrame | None, paired: pd.DataFrame | None) -> None:
    """The pooled test videos' subject-bootstrap intervals, the paired tests over subjects with the family they
    are corrected over, and for the primary metric the verdict beside the smallest difference the test detects."""
    if subjects is None or paired is None:
        print(f"no subject-level intervals or tests: fewer than two of these CVs logged {POOLED_VIDEOS}")
        return
    print("pooled test videos, 95 % subject-bootstrap intervals:")
    print(subjects.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"paired over subjects: mean difference a - b, its 95 % interval and p from one t-test over "
          f"{next(iter(paired['unit']), '')}; p_holm over the primary metric's tests only:")
    shown = paired.drop(columns=["unit", "standard_error"]).assign(
        family=paired["family"].str.split(":").str[0])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(correction_family(paired))
    for row in paired[paired["primary"]].itertuples():
        verdict = "survives" if row.p_holm < FAMILY_ALPHA else "does not survive"
        print(f"{row.model_a} - {row.model_b}: {row.metric} {row.mean_diff:+.3f} ({verdict} Holm); the smallest "
              f"difference this test detects with {MDE_POWER:.0%} power is +-{row.mde80:.3f} "
              f"({row.n_subjects} subjects in {row.n_units} units)")
