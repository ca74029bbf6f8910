"""The rules of `eval.threshold` on simulated folds, by the number of validation subjects: a secondary check of the
default. The default itself is chosen on real folds (scripts/threshold_regret.py, docs/numbers.md "Which rule is the
default"); this shows how the rules behave under conditions drawn on purpose, which real folds cannot vary one at a
time.

A fold chooses its decision threshold on its validation subjects' videos and calls its test subjects' videos at it.
The rule to use is the one whose test balanced accuracy falls least short of the best cut on the test videos (its
regret), under the conditions a pain model meets. The simulation draws them honestly:

- a video's score is sigmoid(z), z on the logit scale: a baseline video z ~ shift + b_s - d/2 + N(0, 1), a pain video
  of a responder z ~ shift + b_s + d/2 + N(0, r) with r the pain class's wider spread (1 or 1.6: pain varies more
  than rest), a pain video of a non-responder (0 % or 23 % of the people, BioVid's 20 of 87) looks like a baseline
  one; b_s ~ N(0, tau) a per-person offset (0.5 or 1.5), d the separation (1, 2, 3), `shift` a miscalibration of the
  whole model (0 or 1.5 logits: every score sits high);
- the validation videos come from the checkpoint chosen on them, so they separate better than the test videos do:
  their d is d * (1 + inflation), inflation 0 or 0.5;
- a fold has n validation subjects (2 as on the twin's kfold5, 4, 12 as on BioVid's folds) with v videos per class
  each (6 as on the twins, 20 as on BioVid); each rule chooses on them (`choose_threshold`, fallbacks included) and is
  scored on 100 new subjects of the same condition; regret = the best cut's balanced accuracy on those minus the
  rule's; `folds` folds per condition, seeded.

Writes <out>/threshold_simulation.csv (every condition x rule: mean test balanced accuracy, its 10th percentile,
mean regret), simulated_regret.csv (mean regret per rule and number of validation subjects, over all conditions and
over the BioVid-like ones) and threshold_simulation.png, and prints the regret tables. The folds of finished CVs are
scripts/threshold_regret.py's (and scripts/check_default_thresholds.py's for the default CVs).

    .venv/bin/python scripts/threshold_simulation.py [--folds 200] [--out DIR]
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

from pipeline.analysis.threshold_regret import best_balanced_accuracy  # noqa: E402
from pipeline.evaluation.thresholds import binary_metrics_at, choose_threshold, measured_rules  # noqa: E402
from pipeline.utils.atomic_io import atomic_write_csv, save_png  # noqa: E402

RULES = (*measured_rules(), 0.5)  # every rule `eval.threshold` names (but a second name of one), and the fixed 0.5
SEPARATIONS = (1.0, 2.0, 3.0)
SHIFTS = (0.0, 1.5)
SUBJECT_SPREADS = (0.5, 1.5)
PAIN_SPREADS = (1.0, 1.6)
NON_RESPONDERS = (0.0, 20 / 87)
INFLATIONS = (0.0, 0.5)
VALIDATION_SUBJECTS = (2, 4, 12)
VIDEOS_PER_CLASS = (6, 20)
TEST_SUBJECTS = 100
# BioVid-like: unequal spreads, the non-responder mixture and an inflated validation set together
HONEST = {"pain_spread": 1.6, "non_responders": 20 / 87, "inflation": 0.5}


def rule_label(rule: str | float) -> str:
    return "fixed_0.5" if rule == 0.5 else str(rule)


def videos(rng: np.random.Generator, subjects: int, per_class: int, separation: float, shift: float, spread: float,
           pain_spread: float, non_responders: float) -> tuple[np.ndarray, np.ndarray]:
    """(labels, scores) of `subjects` people with `per_class` videos of each class (see the module docstring)."""
    offsets = np.repeat(rng.normal(0.0, spread, subjects), 2 * per_class)
    responds = np.repeat(rng.uniform(size=subjects) >= non_responders, 2 * per_class)
    labels = np.tile(np.repeat([0, 1], per_class), subjects)
    pain = (labels == 1) & responds
    noise = rng.normal(0.0, 1.0, labels.size) * np.where(pain, pain_spread, 1.0)
    logits = shift + offsets + np.where(pain, separation / 2, -separation / 2) + noise
    return labels, 1.0 / (1.0 + np.exp(-logits))


def rule_regrets(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 n_val: int) -> dict[str, tuple[float, float]]:
    """Each rule's (test balanced accuracy, regret) when it chooses on `val`."""
    best = best_balanced_accuracy(*test)
    out = {}
    for rule in RULES:
        value = binary_metrics_at(*test, choose_threshold(*val, rule, n_subjects=n_val).threshold)["balanced_accuracy"]
        out[rule_label(rule)] = (value, best - value)
    return out


def simulate(folds: int, seed: int = 0) -> pd.DataFrame:
    rows = []
    conditions = list(itertools.product(SEPARATIONS, SHIFTS, SUBJECT_SPREADS, PAIN_SPREADS, NON_RESPONDERS,
                                        INFLATIONS, VALIDATION_SUBJECTS, VIDEOS_PER_CLASS))
    for index, (separation, shift, spread, pain_spread, non_responders, inflation, n_val, per_class) in enumerate(
            conditions):
        rng = np.random.default_rng([seed, index])
        results: dict[str, list[tuple[float, float]]] = {rule_label(rule): [] for rule in RULES}
        for _ in range(folds):
            val = videos(rng, n_val, per_class, separation * (1 + inflation), shift, spread, pain_spread,
                         non_responders)
            test = videos(rng, TEST_SUBJECTS, per_class, separation, shift, spread, pain_spread, non_responders)
            for rule, value in rule_regrets(val, test, n_val).items():
                results[rule].append(value)
        for rule, values in results.items():
            scores, regrets = np.array(values).T
            rows.append({"separation": separation, "shift": shift, "subject_spread": spread,
                         "pain_spread": pain_spread, "non_responders": round(non_responders, 3),
                         "inflation": inflation, "validation_subjects": n_val, "videos_per_class": per_class,
                         "rule": rule, "mean": scores.mean(), "p10": np.percentile(scores, 10),
                         "regret": regrets.mean(), "regret_p90": np.percentile(regrets, 90)})
    return pd.DataFrame(rows)


def regret_table(table: pd.DataFrame) -> pd.DataFrame:
    """Mean regret (points) per rule and number of validation subjects: over every condition, and over the honest
    BioVid-like ones (`HONEST`) alone."""
    honest = np.logical_and.reduce([np.isclose(table[key], round(value, 3)) for key, value in HONEST.items()])
    parts = {"all conditions": table, "BioVid-like (unequal spreads, non-responders, inflated validation)":
             table[honest]}
    rows = []
    for name, part in parts.items():
        mean = part.groupby(["rule", "validation_subjects"])["regret"].mean().unstack("validation_subjects")
        worst = part.groupby(["rule", "validation_subjects"])["regret"].max().unstack("validation_subjects")
        for rule in mean.index:
            rows.append({"conditions": name, "rule": rule, **{f"mean_{n}": 100 * mean.loc[rule, n] for n in mean},
                         **{f"worst_{n}": 100 * worst.loc[rule, n] for n in worst}})
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, path: Path) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.2))
    panels = [("all conditions", table), ("BioVid-like conditions", table[
        np.logical_and.reduce([np.isclose(table[key], round(value, 3)) for key, value in HONEST.items()])])]
    axes = figure.subplots(1, len(panels), sharey=True)
    for axis, (title, part) in zip(axes, panels, strict=True):
        mean = part.groupby(["rule", "validation_subjects"])["regret"].mean().unstack("rule")
        for rule in mean.columns:
            axis.plot(mean.index, 100 * mean[rule], marker="o", label=rule)
        axis.set_xscale("log")
        axis.set_xticks(VALIDATION_SUBJECTS, [str(n) for n in VALIDATION_SUBJECTS])
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("validation subjects")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("mean regret: best cut's bal. acc. - the rule's (points)")
    axes[-1].legend(fontsize=7)
    figure.suptitle("Threshold rules on simulated folds", fontsize=10)
    save_png(figure, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folds", type=int, default=200, help="simulated folds per condition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "threshold_simulation")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    table = simulate(args.folds, args.seed)
    atomic_write_csv(args.out / "threshold_simulation.csv", table)
    regrets = regret_table(table)
    atomic_write_csv(args.out / "simulated_regret.csv", regrets)
    png = plot(table, args.out / "threshold_simulation.png")
    print("mean (and worst condition's mean) regret in balanced-accuracy points, by validation subjects:")
    print(regrets.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"\n{args.out / 'simulated_regret.csv'}\n{png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
