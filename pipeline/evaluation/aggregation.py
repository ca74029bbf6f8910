"""From frames to a video: one rule, used by the cross-validation (`metrics.aggregate_videos`, over a table of many
videos) and by scoring new video (`pipeline.models.scoring.FrameScorer.video_score`, one video at a time).

`mean` averages each class's probability over the frames; `max` takes each class's highest frame probability and
`topk` the mean of each class's `k` highest (all frames when a video has fewer); both are renormalised to sum to 1,
since per-class maxima come from different frames. The class a video is called (`called_classes`): argmax of its
probabilities, or for an ordinal or regression model over ordered levels `ordinal_decision`. Light on purpose (NumPy
only): `make predict` imports it.
"""

from __future__ import annotations

import numpy as np

AGGREGATIONS = ("mean", "max", "topk")


def check_aggregation(method: str, k: int) -> None:
    """`trainer.aggregation` and `trainer.topk` (configs/trainer/default.yaml holds their defaults), checked."""
    if method not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {method!r}; choose one of {AGGREGATIONS}")
    if method == "topk" and k < 1:
        raise ValueError(f"topk aggregation needs k >= 1, got {k}")


def aggregate_class_probabilities(probabilities: np.ndarray, method: str, k: int) -> np.ndarray:
    """One video's class probabilities (shape (C,)) from its frames' (shape (N, C), N >= 1)."""
    check_aggregation(method, k)
    probs = np.asarray(probabilities, dtype=float)
    if probs.ndim != 2 or len(probs) == 0:
        raise ValueError(f"need frame probabilities of shape (N >= 1, C), got {probs.shape}")
    if method == "mean":
        return probs.mean(axis=0)
    if method == "max":
        video = probs.max(axis=0)
    else:
        video = -np.sort(-probs, axis=0)[:k].mean(axis=0)
    total = video.sum()
    if total <= 0:
        raise ValueError("cannot renormalise aggregated probabilities that sum to 0")
    return video / total


def ordinal_decision(probs: np.ndarray) -> np.ndarray:
    """The level an ordinal model calls from level probabilities (N, K), a video's averaged ones included: the
    number of k with P(level > k) > 0.5 (CORAL's rule, and CORN's on its product-rule probabilities)."""
    probs = np.asarray(probs, dtype=float)
    above = 1.0 - np.cumsum(probs, axis=1)[:, :-1]
    return (above > 0.5).sum(axis=1)


def called_classes(probs: np.ndarray, ordinal: bool = False) -> np.ndarray:
    """The class each row of probabilities (N, C) is called: argmax, or with `ordinal` the level `ordinal_decision`
    calls (an ordinal or regression output's rule, which the mode of its level probabilities is not)."""
    probs = np.asarray(probs, dtype=float)
    return ordinal_decision(probs) if ordinal else np.argmax(probs, axis=1)


def pain_probability(probs: np.ndarray, level: int) -> np.ndarray:
    """P(level >= `level`) from level probabilities (N, K): an ordinal model's binary pain score of a video (its
    frames' mean level probabilities), what the threshold rules take; at level 1 it is 1 - P(BL1), the rule of a
    binary softmax model."""
    probs = np.asarray(probs, dtype=float)
    if not 1 <= level < probs.shape[1]:
        raise ValueError(f"pain level {level} outside 1..{probs.shape[1] - 1}")
    return probs[:, level:].sum(axis=1)
