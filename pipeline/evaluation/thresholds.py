"""The decision threshold of a binary task, chosen on validation videos and applied unchanged to test videos.

A checkpoint selected by AUROC ranks videos well but says nothing about where its probabilities sit: a model whose
scores all lie above 0.5 has a good AUROC and an accuracy at 0.5 of one class's share. The threshold is therefore a
decision of its own, made on the validation subjects of the fold (never its test subjects) by one of these rules:

- `youden`: the ROC point that maximises Youden's J = sensitivity + specificity - 1;
- `balanced_accuracy`: the same optimum stated as balanced accuracy (J = 2 * balanced accuracy - 1), kept as its own
  name because that is what a reader looks for; ties go to the threshold nearest 0.5;
- `equal_error`: the cut point where the false positive rate is nearest the false negative rate;
- `logit_midpoint`: halfway between the class medians of the validation scores on the logit scale (the probability
  of the mean of the two medians' logits): the optimal cut between two classes of equal spread wherever the model's
  probabilities sit, so a shift of calibration moves it as it moves the classes;
- `median_midpoint`: halfway between the class medians on the probability scale: under a calibration shift it is not
  the best cut even with unlimited validation data (kept for the CVs that used it);
- `shrinkage`: Youden's threshold pulled toward 0.5 by the number n of validation subjects, w = n / (n + 10);
- a number in [0, 1]: that fixed threshold (0.5 reproduces argmax on two classes).

The rules are a registry (`THRESHOLD_RULES`, name -> `ThresholdRule`): `eval.threshold`, `threshold_spread`,
pipeline/analysis/threshold_regret.py and scripts/threshold_simulation.py ask it, so a new rule is one
`register_rule` call.

Which to use: scripts/threshold_regret.py compares them on the real folds of finished CVs
(pipeline/analysis/threshold_regret.py), scripts/threshold_simulation.py on simulated folds; the default chosen, and
why, is in docs/numbers.md ("Which rule is the default").

A video is called positive when its score is >= the threshold.

A named rule cannot choose when the validation videos hold one class only, when all their scores are equal, or when
no cut point does better than chance (best J <= 0: uninformative or inverted scores, where the optimum is a cut below
every score that calls every test video pain). Then the fold falls back to 0.5 (argmax), and says why
(`ThresholdChoice.fallback`, logged by the fold as the metric `test/threshold_fallback` and the tag of that name).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

FALLBACK_THRESHOLD = 0.5
# why a named rule could not choose (ThresholdChoice.fallback); "" when it chose
ONE_CLASS = "one class only among the validation videos"
ALL_EQUAL = "all validation scores are equal"
NO_BETTER_THAN_CHANCE = "no cut point beats chance on validation (best Youden J <= 0)"


class ThresholdChoice(NamedTuple):
    threshold: float
    fallback: str = ""  # the reason the rule fell back to FALLBACK_THRESHOLD, "" when it chose


class FoldDecision(NamedTuple):
    """What `decide_fold` returns: the threshold, the test videos with their decisions, the test metrics and the
    reason the threshold fell back to 0.5 ("" when the rule chose it)."""

    threshold: float
    videos: pd.DataFrame
    metrics: dict[str, float]
    fallback: str = ""


def roc_points(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """False and true positive rates at every distinct score used as a cut point (score >= cut is positive), highest
    cut first, after a first cut of +inf that calls nothing positive: `sklearn.metrics.roc_curve(labels, scores,
    drop_intermediate=False)`, the same numbers, without its input checks (a fold's threshold spread computes
    hundreds of these). `labels` are 0/1 with both present."""
    order = np.argsort(scores, kind="mergesort")[::-1]
    ranked, hits = scores[order], labels[order]
    ends = np.r_[np.flatnonzero(np.diff(ranked)), ranked.size - 1]  # the last video of each group of equal scores
    tps = np.r_[0, np.cumsum(hits)[ends]]
    fps = np.r_[0, 1 + ends - tps[1:]]
    return fps / fps[-1], tps / tps[-1], np.r_[np.inf, ranked[ends]]


@dataclass(frozen=True)
class ThresholdRule:
    """A named rule of `eval.threshold`: `cut(labels, scores, n_subjects)`, the threshold it picks on validation
    videos (labels 0/1 of both classes, scores, the number of validation subjects they come from); `measured`:
    whether `threshold_spread` reports how much it moves (a rule that is another one by a second name is not)."""

    name: str
    cut: Callable[[np.ndarray, np.ndarray, int], float]
    measured: bool = True


THRESHOLD_RULES: dict[str, ThresholdRule] = {}


def register_rule(rule: ThresholdRule) -> ThresholdRule:
    """Add a rule that `eval.threshold` may name (a name already taken is an error)."""
    if rule.name in THRESHOLD_RULES:
        raise ValueError(f"a threshold rule named {rule.name!r} exists already")
    THRESHOLD_RULES[rule.name] = rule
    return rule


def measured_rules() -> tuple[str, ...]:
    """The rules `threshold_spread` measures, in the order they were registered."""
    return tuple(name for name, rule in THRESHOLD_RULES.items() if rule.measured)


def parse_rule(rule: str | float) -> str | float:
    """A rule name, or a fixed threshold as a float in [0, 1]; anything else is an error naming the setting."""
    if isinstance(rule, str) and rule in THRESHOLD_RULES:
        return rule
    try:
        value = float(rule)
    except (TypeError, ValueError):
        raise ValueError(f"eval.threshold={rule!r}: expected one of {', '.join(THRESHOLD_RULES)} or a number in "
                         f"[0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"eval.threshold={rule!r}: a fixed threshold must lie in [0, 1]")
    return value


def choose_threshold(labels: np.ndarray, scores: np.ndarray, rule: str | float,
                     n_subjects: int | None = None) -> ThresholdChoice:
    """The threshold on `scores` (positive-class probability per video) that `rule` picks on these labels and,
    where a named rule cannot choose (one class, all scores equal, best J <= 0), 0.5 with the reason. `rule` is the
    config's `eval.threshold` (configs/config.yaml holds its default); `n_subjects`: how many validation subjects the
    videos come from (the `shrinkage` rule needs it)."""
    rule = parse_rule(rule)
    if rule == "shrinkage" and not n_subjects:
        raise ValueError("the shrinkage rule needs the number of validation subjects")
    if not isinstance(rule, str):
        return ThresholdChoice(float(rule))
    labels = np.asarray(labels).astype(int)
    scores = np.asarray(scores, dtype=float)
    if labels.shape != scores.shape or labels.ndim != 1:
        raise ValueError(f"labels and scores must be 1-D of equal length, got {labels.shape} and {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinite values")
    reason = cannot_choose(labels, scores)
    if reason:
        return ThresholdChoice(FALLBACK_THRESHOLD, reason)
    return ThresholdChoice(THRESHOLD_RULES[rule].cut(labels, scores, int(n_subjects or 0)))


def cannot_choose(labels: np.ndarray, scores: np.ndarray) -> str:
    """Why no named rule can choose on these videos (one class, all scores equal, no cut point better than chance),
    or "" where one can."""
    return _youden_points(labels, scores)[0]


def _youden_points(labels: np.ndarray, scores: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    """(`cannot_choose`'s reason, Youden's J at every cut point, the cut points): the ROC computed once."""
    if len(np.unique(labels)) < 2:
        return ONE_CLASS, np.empty(0), np.empty(0)
    if np.all(scores == scores[0]):
        return ALL_EQUAL, np.empty(0), np.empty(0)
    fpr, tpr, candidates = roc_points(labels, scores)
    j = tpr - fpr
    if j.max() <= 1e-12:  # the all-positive and all-negative cuts have J = 0: nothing better exists
        return NO_BETTER_THAN_CHANCE, j, candidates
    return "", j, candidates


def youden_threshold(labels: np.ndarray, scores: np.ndarray, n_subjects: int = 0) -> float:
    """The ROC point that maximises Youden's J; among equally good ones the nearest 0.5 (it moves the decision no
    further than the data asks). 0.5 where no rule can choose (`cannot_choose`)."""
    reason, j, candidates = _youden_points(np.asarray(labels).astype(int), np.asarray(scores, dtype=float))
    if reason:
        return FALLBACK_THRESHOLD
    # roc_curve's first candidate is +inf (nothing positive), J = 0: never the best once some J > 0
    best = np.flatnonzero(np.isclose(j, j.max()))
    finite = [i for i in best if np.isfinite(candidates[i])]
    return float(candidates[min(finite, key=lambda i: (abs(candidates[i] - 0.5), i))])


def threshold_scores(videos: pd.DataFrame, class_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """What a threshold cuts: per video, whether it is of a pain class (not the task's first class, its no-pain or
    lowest one) and its score: the second class's probability on two classes, 1 - P(first class) on more."""
    labels = (videos["label"].to_numpy() != 0).astype(int)
    if len(class_names) == 2:
        return labels, videos[f"prob_{class_names[1]}"].to_numpy()
    return labels, 1.0 - videos[f"prob_{class_names[0]}"].to_numpy()


def video_threshold(val_videos: pd.DataFrame, class_names: Sequence[str], rule: str | float) -> ThresholdChoice:
    """The one threshold decision, for a fold, a final model and a trial alike: `rule` (`eval.threshold`) applied
    to the validation videos' `threshold_scores`, never to a test video."""
    labels, scores = threshold_scores(val_videos, class_names)
    return choose_threshold(labels, scores, rule, n_subjects=val_videos["subject_name"].nunique())


def binary_metrics_at(labels: np.ndarray, scores: np.ndarray, threshold: float) -> dict[str, float]:
    """Accuracy, balanced accuracy, sensitivity (recall of class 1) and specificity (recall of class 0)."""
    labels = np.asarray(labels).astype(int)
    predicted = (np.asarray(scores, dtype=float) >= threshold).astype(int)
    positives, negatives = labels == 1, labels == 0
    sensitivity = float(predicted[positives].mean()) if positives.any() else float("nan")
    specificity = float((1 - predicted[negatives]).mean()) if negatives.any() else float("nan")
    recalls = [v for v in (sensitivity, specificity) if np.isfinite(v)]
    return {
        "accuracy": float((predicted == labels).mean()) if len(labels) else float("nan"),
        "balanced_accuracy": float(np.mean(recalls)) if recalls else float("nan"),
        "sensitivity": sensitivity,
        "specificity": specificity,
    }


def decide_fold(val_videos: pd.DataFrame, test_videos: pd.DataFrame, class_names: Sequence[str],
                rule: str | float) -> FoldDecision:
    """The fold's threshold chosen on its validation videos (`video_threshold`), applied to its test videos.

    Returns the threshold (NaN for a multiclass task, which decides by argmax), the test videos with the columns
    `threshold` and `decision` (the class each video is called) added, the test metrics at that decision:
    `video_accuracy_at_threshold`, `video_balanced_accuracy_at_threshold`, `video_sensitivity_at_threshold`,
    `video_specificity_at_threshold`, beside them `video_accuracy_at_0.5`, and `threshold_fallback` (1 where the
    rule could not choose and 0.5 was used), and the reason for a fallback. Only `val_videos` reach the rule.
    """
    rule = parse_rule(rule)
    test_videos = test_videos.copy()
    if len(class_names) != 2:
        test_videos["threshold"] = float("nan")
        # the class each video was called (`pred`: argmax, an ordinal model's ordinal_decision)
        test_videos["decision"] = (test_videos["pred"].to_numpy() if "pred" in test_videos.columns else
                                   test_videos[[f"prob_{name}" for name in class_names]].to_numpy().argmax(axis=1))
        return FoldDecision(float("nan"), test_videos, {})
    threshold, fallback = video_threshold(val_videos, class_names, rule)
    labels, scores = threshold_scores(test_videos, class_names)
    test_videos["threshold"] = threshold
    test_videos["decision"] = (scores >= threshold).astype(int)
    metrics = {f"video_{name}_at_threshold": value for name, value in binary_metrics_at(labels, scores,
                                                                                       threshold).items()}
    metrics["video_accuracy_at_0.5"] = binary_metrics_at(labels, scores, 0.5)["accuracy"]
    metrics["threshold_fallback"] = float(bool(fallback))
    return FoldDecision(threshold, test_videos, metrics, fallback)


def rule_name(rule: str | float, n_classes: int) -> str:
    """How a fold decides, as a tag: the rule, 'fixed' for a number, 'argmax' for a multiclass task."""
    if n_classes != 2:
        return "argmax"
    rule = parse_rule(rule)
    return rule if isinstance(rule, str) else "fixed"


SHRINKAGE_SUBJECTS = 10  # the shrinkage rule weighs Youden's threshold by n / (n + 10) validation subjects
SPREAD_RESAMPLES = 200


def equal_error_threshold(labels: np.ndarray, scores: np.ndarray, n_subjects: int = 0) -> float:
    """The cut point where the false positive rate is nearest the false negative rate (0.5 with one class)."""
    if len(np.unique(labels)) < 2:
        return FALLBACK_THRESHOLD
    fpr, tpr, candidates = roc_points(np.asarray(labels).astype(int), np.asarray(scores, dtype=float))
    finite = np.isfinite(candidates)
    gap = np.abs(fpr - (1 - tpr))[finite]
    return float(candidates[finite][int(np.argmin(gap))])


def median_midpoint_threshold(labels: np.ndarray, scores: np.ndarray, n_subjects: int = 0) -> float:
    """Halfway between the median score of baseline videos and that of pain videos (0.5 with one class)."""
    if len(np.unique(labels)) < 2:
        return FALLBACK_THRESHOLD
    return float((np.median(scores[labels == 0]) + np.median(scores[labels == 1])) / 2)


LOGIT_EPSILON = 1e-6  # probabilities are clipped to [eps, 1 - eps] before the logit: 0 and 1 have none


def logit_midpoint_threshold(labels: np.ndarray, scores: np.ndarray, n_subjects: int = 0) -> float:
    """The probability halfway between the class medians on the logit scale: sigmoid((median logit of baseline
    videos + median logit of pain videos) / 2) (0.5 with one class)."""
    if len(np.unique(labels)) < 2:
        return FALLBACK_THRESHOLD
    clipped = np.clip(np.asarray(scores, dtype=float), LOGIT_EPSILON, 1 - LOGIT_EPSILON)
    logits = np.log(clipped) - np.log1p(-clipped)
    middle = (np.median(logits[labels == 0]) + np.median(logits[labels == 1])) / 2
    return float(1.0 / (1.0 + np.exp(-middle)))


def shrink(threshold: float, n_subjects: int) -> float:
    """`threshold` pulled toward 0.5 by the number of validation subjects: w * t + (1 - w) * 0.5 with
    w = n / (n + SHRINKAGE_SUBJECTS); two subjects keep a sixth of the move, a BioVid fold's 12 over half."""
    weight = n_subjects / (n_subjects + SHRINKAGE_SUBJECTS)
    return weight * threshold + (1 - weight) * FALLBACK_THRESHOLD


def shrunk_threshold(labels: np.ndarray, scores: np.ndarray, n_subjects: int) -> float:
    """Youden's threshold pulled toward 0.5 by the number of validation subjects (`shrink`)."""
    return shrink(youden_threshold(labels, scores), n_subjects)


for _rule in (ThresholdRule("youden", youden_threshold),
              ThresholdRule("balanced_accuracy", youden_threshold, measured=False),  # Youden's optimum by that name
              ThresholdRule("equal_error", equal_error_threshold),
              ThresholdRule("median_midpoint", median_midpoint_threshold),
              ThresholdRule("logit_midpoint", logit_midpoint_threshold),
              ThresholdRule("shrinkage", shrunk_threshold)):
    register_rule(_rule)


def rule_thresholds(labels: np.ndarray, scores: np.ndarray, n_subjects: int) -> dict[str, float]:
    """Each measured rule's threshold on these validation videos."""
    return {name: THRESHOLD_RULES[name].cut(labels, scores, n_subjects) for name in measured_rules()}


def threshold_spread(val_videos: pd.DataFrame, positive: str, n_resamples: int = SPREAD_RESAMPLES,
                     random_state: int = 0) -> dict[str, float]:
    """How much each rule's threshold varies over a bootstrap of the fold's validation subjects (each resampled
    with all its videos): `threshold_<rule>` on the videos as they are, `threshold_ci95_low_<rule>` and
    `threshold_ci95_high_<rule>` the 2.5 and 97.5 percentiles. Validation videos only: nothing of the test."""
    groups = [(g["label"].to_numpy(dtype=int), g[positive].to_numpy(dtype=float))
              for _, g in val_videos.groupby("subject_name", sort=True)]
    labels, scores = val_videos["label"].to_numpy(dtype=int), val_videos[positive].to_numpy(dtype=float)
    result = {f"threshold_{rule}": value for rule, value in rule_thresholds(labels, scores, len(groups)).items()}
    rng = np.random.default_rng(random_state)
    drawn: dict[str, list[float]] = {key.removeprefix("threshold_"): [] for key in result}
    for _ in range(n_resamples):
        chosen = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        values = rule_thresholds(np.concatenate([c[0] for c in chosen]), np.concatenate([c[1] for c in chosen]),
                                 len(groups))
        for rule, value in values.items():
            drawn[rule].append(value)
    for rule, draws in drawn.items():
        low, high = np.percentile(draws, [2.5, 97.5])
        result.update({f"threshold_ci95_low_{rule}": float(low), f"threshold_ci95_high_{rule}": float(high)})
    return result
