"""Which threshold rule to use with few validation subjects: the rules of `eval.threshold` on simulated folds.

A fold chooses its decision threshold on its validation subjects' videos and calls its test subjects' videos at it.
With two validation subjects (the twin's kfold5) the choice is noisy; with 10-13 (BioVid's LOSO and 5-fold folds)
much less. This simulation asks which rule gives the best test balanced accuracy, on average and in its bad cases,
over conditions a pain model meets, without touching any real test set:

- a video's score is sigmoid(shift + b_s + d * (y - 1/2) + e): y its class (0 baseline, 1 pain), d the separation on
  the logit scale (1, 2, 3: within-person AUROC about 0.76, 0.92, 0.98), b_s ~ N(0, tau) a per-person offset (how
  much people's baselines differ), e ~ N(0, 1), and `shift` a miscalibration of the whole model (0: 0.5 is the right
  cut; 1.5: every score sits high, as a model trained with class weights or on another balance can);
- a fold has n validation subjects (2, 4, 12) with v videos per class each (6 as on the twin, 20 as on BioVid); each
  rule chooses on them (`pipeline.evaluation.thresholds.threshold_choice`, fallbacks included) and is scored on 200
  new subjects of the same condition; `best` is the best threshold on that test set (the ceiling, no rule reaches);
- 400 folds per condition, seeded.

Writes reports/threshold_simulation/threshold_simulation.csv (every condition x rule: mean, 10th percentile and sd of
the test balanced accuracy, mean regret against `best`) and .png, and prints the mean regret per rule and n.

    .venv/bin/python scripts/threshold_simulation.py [--folds 400] [--out reports/threshold_simulation]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.evaluation.thresholds import binary_metrics_at, roc_points, threshold_choice  # noqa: E402
from pipeline.utils.atomic_io import atomic_write_csv, save_png  # noqa: E402

RULES = ("youden", "equal_error", "median_midpoint", "shrinkage", 0.5)
SEPARATIONS = (1.0, 2.0, 3.0)
SHIFTS = (0.0, 1.5)
SUBJECT_SPREADS = (0.5, 1.5)
VALIDATION_SUBJECTS = (2, 4, 12)
VIDEOS_PER_CLASS = (6, 20)
TEST_SUBJECTS = 200


def videos(rng: np.random.Generator, subjects: int, per_class: int, separation: float, shift: float,
           spread: float) -> tuple[np.ndarray, np.ndarray]:
    """(labels, scores) of `subjects` people with `per_class` videos of each class."""
    offsets = np.repeat(rng.normal(0.0, spread, subjects), 2 * per_class)
    labels = np.tile(np.repeat([0, 1], per_class), subjects)
    logits = shift + offsets + separation * (labels - 0.5) + rng.normal(0.0, 1.0, labels.size)
    return labels, 1.0 / (1.0 + np.exp(-logits))


def best_balanced_accuracy(labels: np.ndarray, scores: np.ndarray) -> float:
    """The highest balanced accuracy any cut point reaches on these videos (the ceiling)."""
    fpr, tpr, _ = roc_points(labels, scores)
    return float(np.max((tpr + 1 - fpr) / 2))


def simulate(folds: int, seed: int = 0) -> pd.DataFrame:
    rows = []
    conditions = list(itertools.product(SEPARATIONS, SHIFTS, SUBJECT_SPREADS, VALIDATION_SUBJECTS, VIDEOS_PER_CLASS))
    for index, (separation, shift, spread, n_val, per_class) in enumerate(conditions):
        rng = np.random.default_rng([seed, index])
        results: dict[str, list[float]] = {str(rule): [] for rule in RULES}
        regrets: dict[str, list[float]] = {str(rule): [] for rule in RULES}
        fallbacks: dict[str, int] = {str(rule): 0 for rule in RULES}
        ceiling = []
        for _ in range(folds):
            val = videos(rng, n_val, per_class, separation, shift, spread)
            test = videos(rng, TEST_SUBJECTS, per_class, separation, shift, spread)
            best = best_balanced_accuracy(*test)
            ceiling.append(best)
            for rule in RULES:
                choice = threshold_choice(*val, rule, n_subjects=n_val)
                value = binary_metrics_at(*test, choice.threshold)["balanced_accuracy"]
                results[str(rule)].append(value)
                regrets[str(rule)].append(best - value)
                fallbacks[str(rule)] += bool(choice.fallback)
        for rule in RULES:
            values = np.array(results[str(rule)])
            rows.append({"separation": separation, "shift": shift, "subject_spread": spread,
                         "validation_subjects": n_val, "videos_per_class": per_class,
                         "rule": "fixed_0.5" if rule == 0.5 else rule, "mean": values.mean(),
                         "p10": np.percentile(values, 10), "sd": values.std(), "best_mean": np.mean(ceiling),
                         "regret": np.mean(regrets[str(rule)]), "fallbacks": fallbacks[str(rule)] / folds})
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, path: Path) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    axes = figure.subplots(1, len(SHIFTS) * len(VIDEOS_PER_CLASS), sharey=True)
    panels = list(itertools.product(SHIFTS, VIDEOS_PER_CLASS))
    for axis, (shift, per_class) in zip(axes, panels, strict=True):
        part = table[(table["shift"] == shift) & (table["videos_per_class"] == per_class)]
        mean = part.groupby(["rule", "validation_subjects"])["regret"].mean().unstack("rule")
        for rule in mean.columns:
            axis.plot(mean.index, 100 * mean[rule], marker="o", label=rule)
        axis.set_xscale("log")
        axis.set_xticks(VALIDATION_SUBJECTS, [str(n) for n in VALIDATION_SUBJECTS])
        axis.set_title(f"shift {shift:g}, {per_class} videos/class", fontsize=9)
        axis.set_xlabel("validation subjects")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("mean regret: best cut's bal. acc. - the rule's (points)")
    axes[-1].legend(fontsize=7)
    figure.suptitle("Threshold rules on simulated folds (mean over separations and subject spreads)", fontsize=10)
    save_png(figure, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folds", type=int, default=400, help="simulated folds per condition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "threshold_simulation")
    args = parser.parse_args(argv)
    table = simulate(args.folds, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(args.out / "threshold_simulation.csv", table)
    png = plot(table, args.out / "threshold_simulation.png")
    summary = table.pivot_table(index="rule", columns=["shift", "validation_subjects"], values="regret",
                                aggfunc="mean")
    print("mean regret in balanced-accuracy points (best cut on the test set minus the rule's), by shift and "
          "validation subjects, averaged over separations, subject spreads and videos per class:")
    print((100 * summary).round(2).to_string())
    worst = table.groupby("rule")["regret"].max()
    print("\nworst condition's mean regret per rule (points): "
          + ", ".join(f"{rule} {100 * value:.1f}" for rule, value in worst.sort_values().items()))
    print(f"\n{args.out / 'threshold_simulation.csv'}\n{png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
