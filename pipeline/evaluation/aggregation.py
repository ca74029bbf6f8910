"""From frames to a video: one rule, used by the cross-validation (`metrics.aggregate_videos`, over a table of many
videos) and by scoring new video (`pipeline.models.scoring.FrameScorer.video_score`, one video at a time).

`mean` averages each class's probability over the frames; `max` takes each class's highest frame probability and
`topk` the mean of each class's `k` highest (all frames when a video has fewer); both are renormalised to sum to 1,
since per-class maxima come from different frames. The class a video is called (`called_classes`) follows one
decoding rule, `eval.decoding`, whatever the output (`DECODINGS`): `argmax` (the most probable class or level),
`median` (the median level: the number of k with P(level > k) > 0.5, CORAL's rule, which minimises the expected
absolute error) or `expected` (the expected level, rounded). Each reads only the probabilities, so a softmax and an
ordinal model decoded by one rule differ only in what they learned. On two classes the three agree (a tie, p = 0.5,
is no pain under each). Light on purpose (NumPy only): `make predict` imports it.
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


def _as_probabilities(probs: np.ndarray) -> np.ndarray:
    probs = np.asarray(probs, dtype=float)
    if probs.ndim != 2 or probs.shape[1] < 2:
        raise ValueError(f"need class or level probabilities of shape (N, K >= 2), got {probs.shape}")
    return probs


def argmax_decision(probs: np.ndarray) -> np.ndarray:
    """The most probable class (the lowest of tied ones): the mode of a level distribution."""
    return np.argmax(_as_probabilities(probs), axis=1)


def ordinal_decision(probs: np.ndarray) -> np.ndarray:
    """The median level of level probabilities (N, K), a video's averaged ones included: the number of k with
    P(level > k) > 0.5 (CORAL's rule, and CORN's on its product-rule probabilities)."""
    above = 1.0 - np.cumsum(_as_probabilities(probs), axis=1)[:, :-1]
    return (above > 0.5).sum(axis=1)


def expected_decision(probs: np.ndarray) -> np.ndarray:
    """The expected level sum_k k P(level = k), rounded to the nearest level (a half rounds down, toward no pain)."""
    probs = _as_probabilities(probs)
    expected = probs @ np.arange(probs.shape[1], dtype=float)
    return np.clip(np.ceil(expected - 0.5), 0, probs.shape[1] - 1).astype(int)


# `eval.decoding`: how class or level probabilities (N, K) become the class each row is called, for every output
DECODINGS = {"argmax": argmax_decision, "median": ordinal_decision, "expected": expected_decision}


def check_decoding(rule: str) -> None:
    if rule not in DECODINGS:
        raise ValueError(f"eval.decoding={rule!r}: expected one of {', '.join(DECODINGS)}")


def checked_decoding(rule: object) -> str:
    """`eval.decoding` as a rule name, checked."""
    check_decoding(str(rule))
    return str(rule)


def called_classes(probs: np.ndarray, decoding: str) -> np.ndarray:
    """The class each row of probabilities (N, C) is called by the rule `decoding` (`DECODINGS`), the same rule for a
    softmax's class probabilities and an ordinal or regression output's level probabilities."""
    check_decoding(decoding)
    return DECODINGS[decoding](probs)


def pain_probability(probs: np.ndarray, level: int) -> np.ndarray:
    """P(level >= `level`) from level probabilities (N, K): an ordinal model's binary pain score of a video (its
    frames' mean level probabilities), what the threshold rules take; at level 1 it is 1 - P(BL1), the rule of a
    binary softmax model."""
    probs = np.asarray(probs, dtype=float)
    if not 1 <= level < probs.shape[1]:
        raise ValueError(f"pain level {level} outside 1..{probs.shape[1] - 1}")
    return probs[:, level:].sum(axis=1)
