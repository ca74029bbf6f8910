"""`make fidelity`: how hard a twin is, measured by a reference method whose published figures on BioVid are known.

A power or `mde80` measured on a twin says something about BioVid only where the twin is as hard as BioVid. This sets
the twin's difficulty against the literature with an instrument that needs no trained network: the reference method
of Werner et al. 2017 (`pipeline.evaluation.reference_method`: descriptors of each clip's facial activity over time,
a random forest, leave one subject out), fed with the twin's own per-frame action units and head pose (exact, from
the generator: `pipeline.data.synthetic.traces`) plus a tracker's error (`fidelity.reference.tracker_noise`). Its
accuracy per task is the twin's curve; the figure the method's authors published on BioVid Part A (LOSO over the 87
people, video only: configs/literature/biovid_part_a.csv) is the published one. A task whose twin figure is farther
from the published one than its band (`fidelity.bands`), or binary tasks whose twin figures do not rise from PA1 to
PA4, fail the command (exit status 1). Intervals are percentile subject-bootstrap intervals of the twin's mean
per-person accuracy (each person has the same number of clips, so it equals the pooled accuracy).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf
from scipy import stats

from pipeline.analysis.results_table import TASK_LABELS, read_literature
from pipeline.data.prepare import is_twin, synthetic_config
from pipeline.data.synthetic.dataset import recorded_settings
from pipeline.data.synthetic.traces import ClipTraces, clip_traces
from pipeline.data.tasks import CLASS_NAMES, get_task
from pipeline.evaluation.reference_method import (
    ForestSettings,
    TrackerNoise,
    describe,
    loso_predictions,
    subject_accuracies,
    tracked,
)
from pipeline.evaluation.statistics import CONFIDENCE
from pipeline.utils.atomic_io import atomic_write_text, save_png
from pipeline.utils.paths import resolve_path

BINARY_TASKS = ("bl1_vs_pa1", "bl1_vs_pa2", "bl1_vs_pa3", "bl1_vs_pa4")  # the curve that must rise


@dataclass(frozen=True)
class ReferenceSettings:
    """The reference instrument: a tracker's error, its seed, and the forest."""

    noise: TrackerNoise
    noise_seed: int
    forest: ForestSettings


def reference_settings(section: DictConfig) -> ReferenceSettings:
    """`fidelity.reference` as typed settings."""
    noise = section.tracker_noise
    return ReferenceSettings(
        noise=TrackerNoise(sd=(*(float(noise.au),) * 4, float(noise.pose_deg), float(noise.pose_deg),
                               float(noise.position)), correlation_s=float(noise.correlation_s)),
        noise_seed=int(section.noise_seed),
        forest=ForestSettings(trees=int(section.forest.trees), min_samples_leaf=int(section.forest.min_samples_leaf),
                              max_samples=float(section.forest.max_samples), seed=int(section.forest.seed),
                              jobs=int(section.forest.jobs)))


def reference_accuracies(traces: ClipTraces, settings: ReferenceSettings, tasks: Sequence[str],
                         folds: int | None = None, progress: bool = True) -> dict[str, np.ndarray]:
    """Per task, each person's accuracy (%) under the reference method (subjects in sorted order): LOSO, or grouped
    `folds` (a search's cheaper stand-in)."""
    features = describe(tracked(traces.values, traces.fps, settings.noise, settings.noise_seed), traces.fps)
    accuracies = {}
    for name in tasks:
        started = time.time()
        task = get_task(name)
        keep = np.isin(traces.class_ids, [CLASS_NAMES.index(c) for c in task.classes])
        labels = np.array([task.label_map()[CLASS_NAMES[c]] for c in traces.class_ids[keep]])
        subjects = traces.subject_names[keep]
        predicted = loso_predictions(features[keep], labels, subjects, settings.forest, folds)
        accuracies[name] = 100.0 * subject_accuracies(labels, predicted, subjects)
        if progress:
            print(f"fidelity: {TASK_LABELS[name]}: {accuracies[name].mean():.1f} % over {len(accuracies[name])} "
                  f"people, {'LOSO' if folds is None else f'{folds} grouped folds'} ({time.time() - started:.0f} s)",
                  flush=True)
    return accuracies


def published_targets(literature: pd.DataFrame, method: str, tasks: Sequence[str]) -> dict[str, dict]:
    """Per task, the reference method's published LOSO-87 video accuracy with its citation and how it was read; an
    error names a task the literature file has no such row for."""
    rows = literature[(literature["method"] == method) & (literature["protocol"] == "loso")
                      & (literature["subjects"] == "87") & (literature["modality"] == "video")]
    targets = {}
    for task in tasks:
        found = rows[rows["task"] == task]
        if len(found) != 1:
            raise SystemExit(f"fidelity: configs/literature/biovid_part_a.csv has {len(found)} LOSO-87 video rows of "
                             f"{method!r} for {task}, not one")
        row = found.iloc[0]
        targets[task] = {"published": float(row.accuracy), "read": row.read, "note": row.note,
                         "source": f"{row.authors}, {row.year}, {row.venue}: {row.method}"}
    return targets


def mean_interval(values: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """95 % percentile interval of the mean of `values` (one per person) over people drawn with replacement."""
    result = stats.bootstrap((values,), np.mean, n_resamples=resamples, confidence_level=CONFIDENCE,
                             method="percentile", rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def fidelity_rows(accuracies: dict[str, np.ndarray], targets: dict[str, dict], bands: Mapping[str, float],
                  resamples: int, seed: int) -> dict[str, dict]:
    """Per task: published, twin (mean over people), its interval, band, whether within it, and the source."""
    rows = {}
    for task, values in accuracies.items():
        low, high = mean_interval(values, resamples, seed)
        twin, published, band = float(values.mean()), targets[task]["published"], float(bands[task])
        rows[task] = {"published": published, "twin": round(twin, 2), "low": round(low, 2), "high": round(high, 2),
                      "difference": round(twin - published, 2), "band": band,
                      "within_band": bool(abs(twin - published) <= band), "n_subjects": len(values),
                      **{key: targets[task][key] for key in ("source", "read", "note")}}
    return rows


def is_rising(rows: dict[str, dict]) -> bool:
    """Whether the twin's binary figures rise from PA1 to PA4 (True where fewer than two of them were measured)."""
    curve = [rows[task]["twin"] for task in BINARY_TASKS if task in rows]
    return all(a < b for a, b in zip(curve, curve[1:], strict=False))


def plot_curves(rows: dict[str, dict], path: Path, title: str) -> None:
    """The twin's curve (with its intervals) beside the published one: binary tasks left, five classes right."""
    figure = Figure(figsize=(9, 3.8))
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1]})
    for axis, tasks, chance in ((left, [t for t in BINARY_TASKS if t in rows], 50.0),
                                (right, [t for t in ("five_class",) if t in rows], 20.0)):
        x = np.arange(len(tasks))
        published = np.array([rows[t]["published"] for t in tasks])
        bands = np.array([rows[t]["band"] for t in tasks])
        if len(tasks) > 1:
            axis.fill_between(x, published - bands, published + bands, color="tab:grey", alpha=0.25, label="band")
        else:
            axis.bar(x, 2 * bands, bottom=published - bands, width=0.5, color="tab:grey", alpha=0.25)
        axis.plot(x, published, "s--", color="tab:grey", label="published (BioVid)")
        twin = np.array([rows[t]["twin"] for t in tasks])
        error = np.array([[rows[n]["twin"] - rows[n]["low"] for n in tasks],
                          [rows[n]["high"] - rows[n]["twin"] for n in tasks]])
        axis.errorbar(x, twin, yerr=error, fmt="o-", color="tab:red", capsize=4, label="twin, 95 % interval")
        axis.axhline(chance, color="black", lw=0.6, ls=":")
        axis.set_xticks(x, [TASK_LABELS[t] for t in tasks])
        axis.set_xlim(-0.5, len(tasks) - 0.5)
    left.set_ylabel("accuracy %, LOSO")
    left.legend(loc="upper left", fontsize=8)
    figure.suptitle(title, fontsize=10)
    save_png(figure, path)


def run_fidelity(cfg: DictConfig) -> dict:
    """`make fidelity DATA=<twin>`: the reference curve of the twin beside the published one; JSON and PNG into
    `<reports>/fidelity/`; SystemExit(1) where a task is outside its band or the binary curve does not rise."""
    if not is_twin(cfg.data):
        raise SystemExit(f"fidelity measures a synthetic twin (DATA=synthetic87); {cfg.data.name} has no generator")
    started = time.time()
    section = cfg.fidelity
    config = synthetic_config(cfg.data.synthetic)
    settings = reference_settings(section.reference)
    tasks = list(section.tasks)
    targets = published_targets(read_literature(), str(section.published_method), tasks)
    print(f"fidelity: {cfg.data.name}, {config.n_subjects} people x 5 classes x {config.samples_per_class} clips; "
          f"reference: {section.published_method}, LOSO", flush=True)
    accuracies = reference_accuracies(clip_traces(config), settings, tasks)
    rows = fidelity_rows(accuracies, targets, {task: float(band) for task, band in section.bands.items()},
                         int(section.bootstrap.resamples), int(section.bootstrap.seed))
    rising = is_rising(rows)
    passed = rising and all(row["within_band"] for row in rows.values())
    report = {"data": cfg.data.name, "passed": passed, "rising": rising, "tasks": rows,
              "reference": OmegaConf.to_container(section.reference), "published_method": section.published_method,
              "twin": recorded_settings(config), "seconds": round(time.time() - started, 1)}
    out_dir = resolve_path(cfg.reports_dir) / "fidelity"
    paths = {"json": out_dir / f"{cfg.data.name}.json", "plot": out_dir / f"{cfg.data.name}.png"}
    atomic_write_text(paths["json"], json.dumps(report, indent=2, default=list) + "\n")
    plot_curves(rows, paths["plot"], f"{cfg.data.name}: the reference method on the twin and on BioVid (published)")
    print_fidelity(rows, rising, paths)
    if not passed:
        raise SystemExit(1)
    return report


def print_fidelity(rows: dict[str, dict], rising: bool, paths: dict[str, Path]) -> None:
    """The twin's curve beside the published one, a task a line."""
    print(f"{'task':<14}{'published':>10}{'twin':>8}{'95 % interval':>17}{'band':>7}  within  source")
    for task, row in rows.items():
        interval, band = f"[{row['low']:.1f}, {row['high']:.1f}]", f"±{row['band']:g}"
        print(f"{TASK_LABELS[task]:<14}{row['published']:>10.1f}{row['twin']:>8.1f}{interval:>17}{band:>7}  "
              f"{'yes' if row['within_band'] else 'NO':<6}  {row['source']} ({row['read']})")
    print(f"binary curve rises PA1 < PA2 < PA3 < PA4: {'yes' if rising else 'NO'}")
    print(f"written: {paths['json']}, {paths['plot']}")

