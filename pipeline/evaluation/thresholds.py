"""The decision threshold of a binary task, chosen on validation videos and applied unchanged to test videos.

A checkpoint selected by AUROC ranks videos well but says nothing about where its probabilities sit: a model whose
scores all lie above 0.5 has a good AUROC and an accuracy at 0.5 of one class's share. The threshold is therefore a
decision of its own, made on the validation subjects of the fold (never its test subjects) by one of three rules:

- `youden`: the ROC point that maximises Youden's J = sensitivity + specificity - 1;
- `balanced_accuracy`: the same optimum stated as balanced accuracy (J = 2 * balanced accuracy - 1), kept as its own
  name because that is what a reader looks for; ties go to the threshold nearest 0.5;
- a number in [0, 1]: that fixed threshold (0.5 reproduces argmax on two classes).

A video is called positive when its score is >= the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from sklearn.metrics import roc_curve

RULES = ("youden", "balanced_accuracy")


def parse_rule(rule: str | float) -> str | float:
    """A rule name, or a fixed threshold as a float in [0, 1]; anything else is an error naming the setting."""
    if isinstance(rule, str) and rule in RULES:
        return rule
    try:
        value = float(rule)
    except (TypeError, ValueError):
        raise ValueError(f"eval.threshold={rule!r}: expected one of {', '.join(RULES)} or a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"eval.threshold={rule!r}: a fixed threshold must lie in [0, 1]")
    return value


def choose_threshold(labels: np.ndarray, scores: np.ndarray, rule: str | float = "youden") -> float:
    """The threshold on `scores` (positive-class probability per video) that `rule` picks on these labels.

    With one class only among `labels` no rule can choose, so the result is 0.5 (argmax) for the named rules.
    """
    rule = parse_rule(rule)
    if not isinstance(rule, str):
        return float(rule)
    labels = np.asarray(labels).astype(int)
    scores = np.asarray(scores, dtype=float)
    if labels.shape != scores.shape or labels.ndim != 1:
        raise ValueError(f"labels and scores must be 1-D of equal length, got {labels.shape} and {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinite values")
    if len(np.unique(labels)) < 2:
        return 0.5
    fpr, tpr, candidates = roc_curve(labels, scores, drop_intermediate=False)
    # roc_curve's first candidate is +inf (nothing positive); it is never the best for two classes present
    j = tpr - fpr
    best = np.flatnonzero(np.isclose(j, j.max()))
    finite = [i for i in best if np.isfinite(candidates[i])]
    if not finite:
        return 1.0
    # among equally good cut points, the one nearest 0.5: it moves the decision no further than the data asks
    chosen = min(finite, key=lambda i: (abs(candidates[i] - 0.5), i))
    return float(candidates[chosen])


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
                rule: str | float = "youden") -> tuple[float, pd.DataFrame, dict[str, float]]:
    """The fold's threshold chosen on its validation videos, applied to its test videos.

    Returns the threshold (NaN for a multiclass task, which decides by argmax), the test videos with the columns
    `threshold` and `decision` (the class each video is called) added, and the test metrics at that decision:
    `video_accuracy_at_threshold`, `video_balanced_accuracy_at_threshold`, `video_sensitivity_at_threshold`,
    `video_specificity_at_threshold` and, beside them, `video_accuracy_at_0.5`. Only `val_videos` reach the rule.
    """
    rule = parse_rule(rule)
    test_videos = test_videos.copy()
    if len(class_names) != 2:
        test_videos["threshold"] = float("nan")
        test_videos["decision"] = test_videos[[f"prob_{name}" for name in class_names]].to_numpy().argmax(axis=1)
        return float("nan"), test_videos, {}
    positive = f"prob_{class_names[1]}"
    threshold = choose_threshold(val_videos["label"].to_numpy(), val_videos[positive].to_numpy(), rule)
    labels, scores = test_videos["label"].to_numpy(), test_videos[positive].to_numpy()
    test_videos["threshold"] = threshold
    test_videos["decision"] = (scores >= threshold).astype(int)
    metrics = {f"video_{name}_at_threshold": value for name, value in binary_metrics_at(labels, scores,
                                                                                       threshold).items()}
    metrics["video_accuracy_at_0.5"] = binary_metrics_at(labels, scores, 0.5)["accuracy"]
    return threshold, test_videos, metrics


def rule_name(rule: str | float, n_classes: int) -> str:
    """How a fold decides, as a tag: the rule, 'fixed' for a number, 'argmax' for a multiclass task."""
    if n_classes != 2:
        return "argmax"
    rule = parse_rule(rule)
    return rule if isinstance(rule, str) else "fixed"
