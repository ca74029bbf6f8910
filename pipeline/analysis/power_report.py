"""What `make power`'s resampled studies report (pipeline/analysis/resampled_power.py): per study and level the
rejection rates of `make compare`'s test and of the subject-level test with Clopper-Pearson intervals, both copies'
accuracy in the replicates and on the population, the true and the observed difference and the `mde80` the test
printed; where the curve crosses 80 % power; every study's curve in one plot (`power.png`); the tables written and
logged as a run of kind `power`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from mlflow import MlflowClient
from scipy import stats

from pipeline.runs.store import tracking
from pipeline.utils.atomic_io import atomic_write_csv, atomic_write_text, save_png
from pipeline.utils.paths import PROJECT_ROOT, resolve_path

EXPERIMENT = "pain-power"  # make power's runs, apart from real work
TARGET_POWER = 0.8


def clopper_pearson(rejections: int, repeats: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact binomial interval of a rate of `rejections` in `repeats` (scipy's binomtest)."""
    interval = stats.binomtest(int(rejections), int(repeats)).proportion_ci(confidence, method="exact")
    return float(interval.low), float(interval.high)


def summarise_study(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per level of a study's replicates: both tests' rejection rates with their Clopper-Pearson intervals,
    the copies' accuracy (mean and sd over replicates; on the population: the truth), the true and the observed
    mean difference, the test's units and its mean and median `mde80`."""
    out = []
    for (effect, protocol, seeds, knob, level), part in rows.groupby(["effect", "protocol", "seeds", "knob", "level"],
                                                                     sort=True):
        n = len(part)
        summary = {"effect": effect, "protocol": protocol, "seeds": int(seeds), "knob": knob, "level": float(level),
                   "replicates": n}
        for prefix, column in (("", "rejected"), ("subject_", "rejected_subject")):
            k = int(part[column].astype(bool).sum())
            low, high = clopper_pearson(k, n)
            summary.update({f"{prefix}rejections": k, f"{prefix}rate": k / n, f"{prefix}rate_ci95_low": low,
                            f"{prefix}rate_ci95_high": high})
        true_a, true_b = part["true_a"].mean(), part["true_b"].mean()
        summary.update({"value_a": part["value_a"].mean(), "value_a_sd": part["value_a"].std(ddof=1),
                        "value_b": part["value_b"].mean(), "value_b_sd": part["value_b"].std(ddof=1),
                        "true_a": true_a, "true_b": true_b, "true_diff": true_a - true_b,
                        "truth_replicates": int(part["true_a"].notna().sum()),
                        "mean_diff": part["mean_diff"].mean(), "sd_diff": part["mean_diff"].std(ddof=1),
                        "n_units": int(part["n_units"].median()), "n_subjects": int(part["n_subjects"].median()),
                        "mean_mde80": part["mde80"].mean(), "median_mde80": part["mde80"].median(),
                        "alpha": float(part["alpha"].iloc[0]), "seconds_per_replicate": part["seconds"].median()})
        out.append(summary)
    return pd.DataFrame(out)


def eighty_percent_point(summary: pd.DataFrame, rate: str = "rate") -> float:
    """The size of the true difference (either sign: copy b may be the better or the worse) at which a study's power
    curve first reaches 80 %, interpolated linearly between its levels (ordered by that size); NaN where it never
    does."""
    curve = summary.dropna(subset=["true_diff"]).assign(size=lambda t: t["true_diff"].abs()).sort_values("size")
    x, y = curve["size"].to_numpy(), curve[rate].to_numpy()
    above = np.flatnonzero(y >= TARGET_POWER)
    if not len(above):
        return float("nan")
    i = int(above[0])
    if i == 0:
        return float(x[0])
    return float(x[i - 1] + (TARGET_POWER - y[i - 1]) * (x[i] - x[i - 1]) / (y[i] - y[i - 1]))


def label_of(protocol: str, seeds: int) -> str:
    return f"{protocol}, {seeds} training seed{'s' if seeds > 1 else ''} a copy"


def plot_power_curves(summary: pd.DataFrame, path: Path) -> None:
    """Every study's rejection rate against the true difference (the population's), with Clopper-Pearson bars:
    `make compare`'s test solid, the subject-level test dashed; alpha and 80 % marked, each study's mean `mde80` at
    80 % as a cross."""
    figure = Figure(figsize=(8, 5))
    axes = figure.subplots()
    colours = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:grey"])
    for (protocol, seeds), part in summary.groupby(["protocol", "seeds"], sort=True):
        colour = next(colours)
        part = part.assign(size=part["true_diff"].fillna(part["mean_diff"]).abs()).sort_values("size")
        x = 100 * part["size"]
        for prefix, style, name in (("", "-o", "fold-grouped t (make compare)"),
                                    ("subject_", "--s", "subject permutation (before)")):
            rate = part[f"{prefix}rate"]
            errors = np.vstack([rate - part[f"{prefix}rate_ci95_low"], part[f"{prefix}rate_ci95_high"] - rate])
            axes.errorbar(x, rate, yerr=errors.clip(min=0), fmt=style, color=colour, capsize=3, ms=4,
                          alpha=1.0 if not prefix else 0.6, label=f"{label_of(protocol, int(seeds))}: {name}")
        axes.plot([100 * part["mean_mde80"].mean()], [TARGET_POWER], "x", color=colour, ms=10, mew=2)
    axes.axhline(0.05, color="tab:red", ls=":", lw=1, label="alpha 0.05")
    axes.axhline(TARGET_POWER, color="grey", ls=":", lw=1)
    axes.set_xlabel("size of the true accuracy difference |a - b| on the population (points)")
    axes.set_ylabel("rejection rate")
    axes.set_ylim(0, 1.02)
    axes.set_title("make compare's paired test, 87 people a replicate (x: the mean mde80 it printed)", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    save_png(figure, path)


def write_summary(record: pd.DataFrame, out_dir: Path) -> tuple[pd.DataFrame, dict[str, Path]]:
    """Every study's summary in the record (`summarise_study`, with its 80 % point), written as CSV and JSON beside
    the plot of their curves."""
    parts = [summarise_study(rows).assign(study=key) for key, rows in record.groupby("study", sort=False)]
    summary = pd.concat(parts, ignore_index=True)
    for _, part in summary.groupby("study", sort=False):
        summary.loc[part.index, "eighty_percent_point"] = eighty_percent_point(part)
        summary.loc[part.index, "subject_eighty_percent_point"] = eighty_percent_point(part, "subject_rate")
    paths = {"summary": out_dir / "power_summary.csv", "json": out_dir / "power_summary.json",
             "plot": out_dir / "power.png", "replicates": out_dir / "replicates.csv"}
    atomic_write_csv(paths["summary"], summary)
    atomic_write_text(paths["json"], json.dumps(summary.to_dict("records"), indent=2, default=float) + "\n")
    plot_power_curves(summary, paths["plot"])
    return summary, paths


def print_summary(summary: pd.DataFrame, study: str, same_configuration: bool = False) -> None:
    """The study's table: per level both tests' rates, the copies' accuracy, the true difference and the mde80. An
    A/A (`same_configuration`) says that its copies differ only in their training seeds."""
    rows = summary[summary["study"] == study]
    for row in rows.itertuples():
        copies = ("copies differing only in their training seeds" if same_configuration
                  else f"copy b's {row.knob} {row.level:g}")
        print(f"{row.effect} {label_of(row.protocol, row.seeds)}, {copies}: "
              f"{row.rejections} of {row.replicates} rejected = {row.rate:.3f} [95 % Clopper-Pearson "
              f"{row.rate_ci95_low:.3f}, {row.rate_ci95_high:.3f}] by make compare's test ({row.n_units} units); "
              f"the subject-level permutation test {row.subject_rate:.3f} [{row.subject_rate_ci95_low:.3f}, "
              f"{row.subject_rate_ci95_high:.3f}]; accuracy a {row.value_a:.3f} (sd {row.value_a_sd:.3f}), b "
              f"{row.value_b:.3f} (sd {row.value_b_sd:.3f}) in the replicates, {row.true_a:.3f} and {row.true_b:.3f} "
              f"on the population ({row.truth_replicates} replicates): true difference {row.true_diff:+.4f}, "
              f"observed {row.mean_diff:+.4f} (sd {row.sd_diff:.4f}); mde80 mean {row.mean_mde80:.3f}, median "
              f"{row.median_mde80:.3f}; {row.seconds_per_replicate:.1f} s a replicate")
    point = rows["eighty_percent_point"].iloc[0] if len(rows) > 1 else float("nan")
    if np.isfinite(point):
        print(f"80 % power at a true difference of {point:.4f} (interpolated); make compare's mean mde80 "
              f"{rows['mean_mde80'].mean():.4f}")


def log_study(mlflow: Mapping[str, Any], power_yaml: str, summary: pd.DataFrame, study: str,
              paths: dict[str, Path]) -> str:
    """The study's summary as a run of kind `power` in the power experiment (the `mlflow` group's store), with the
    tables, the plot and the `power` group as `power_yaml` records it."""
    client = MlflowClient(tracking.store_uri(mlflow["tracking_uri"]))
    artifact_root = (resolve_path(mlflow["artifact_root"]) if mlflow["artifact_root"]
                     else tracking.artifact_root(PROJECT_ROOT))
    experiment_id = tracking.get_or_create_experiment(EXPERIMENT, artifact_root, client=client)
    rows = summary[summary["study"] == study]
    first = rows.iloc[0]
    name = f"power {first['effect']} {label_of(str(first['protocol']), int(first['seeds']))}"
    run = client.create_run(experiment_id, run_name=name,
                            tags={tracking.RUN_KIND_TAG: tracking.POWER_RUN, tracking.EFFECT_TAG: str(first["effect"]),
                                  tracking.MEASURES_TAG: "type-I error" if set(rows["level"]) == {0.0} else "power",
                                  tracking.COMPARISON_TAG: "copy a - copy b", tracking.TEST_UNIT_TAG: f"fold of "
                                  f"{first['protocol']} ({int(first['n_units'])} units)",
                                  tracking.POWER_STUDY_TAG: study})
    for row in rows.itertuples():
        for key in ("rate", "rate_ci95_low", "rate_ci95_high", "subject_rate", "true_diff", "mean_mde80",
                    "value_a", "value_b", "replicates"):
            client.log_metric(run.info.run_id, f"power/level_{row.level:g}/{key}", float(getattr(row, key)))
    client.log_text(run.info.run_id, power_yaml, "power.yaml")
    for path in paths.values():
        client.log_artifact(run.info.run_id, str(path), "power")
    client.set_terminated(run.info.run_id, tracking.FINISHED)
    return run.info.run_id
