"""A reference method in the spirit of Werner et al. (IEEE Trans. Affective Computing 8(3), 2017): each clip's facial
activity over time condensed into descriptors, a random forest over them, leave one subject out.

The signals are a tracker's view of a face (action-unit intensities, head pose), here given as exact per-frame values
(a twin's truth) to which `tracked` adds a tracker's error: per signal, noise whose frames are correlated over
`correlation_s` (an AR(1) process: a tracker jitters smoothly, it does not draw fresh noise every frame). `describe`
turns each signal into statistics of its level, its change over the clip and its first two derivatives (Werner's
facial activity descriptors, simplified: no landmark distances, the action units themselves). `loso_predictions`
scores every clip with a forest trained on every other person. Everything is seeded: the same inputs give the same
predictions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter
from sklearn.ensemble import RandomForestClassifier

# Per signal, in this order (`descriptor_names`): the level (mean, median, min, max, range, sd, interquartile range),
# its trend over the clip (least-squares slope per second), when it peaks (seconds from the window's start), its speed
# (first derivative per second: mean absolute, max, min, sd) and acceleration (second derivative: mean absolute, sd).
DESCRIPTORS = ("mean", "median", "min", "max", "range", "sd", "iqr", "slope", "peak_time", "speed_mean_abs",
               "speed_max", "speed_min", "speed_sd", "acceleration_mean_abs", "acceleration_sd")


@dataclass(frozen=True)
class TrackerNoise:
    """A tracker's error: its sd per signal (in the signal's units) and how long it stays correlated."""

    sd: tuple[float, ...]
    correlation_s: float

    def __post_init__(self) -> None:
        if any(value < 0 for value in self.sd) or self.correlation_s < 0:
            raise ValueError(f"tracker noise needs sds >= 0 and correlation_s >= 0, got {self.sd}, "
                             f"{self.correlation_s}")


@dataclass(frozen=True)
class ForestSettings:
    """The random forest of the reference method (scikit-learn's `RandomForestClassifier`)."""

    trees: int
    min_samples_leaf: int
    max_samples: float  # the share of the training clips each tree draws (bootstrap), for speed
    seed: int
    jobs: int


def tracked(values: np.ndarray, fps: float, noise: TrackerNoise, seed: int) -> np.ndarray:
    """`values` (clips x frames x signals) as a tracker measures them: plus stationary AR(1) noise of sd `noise.sd`
    per signal, frames `correlation_s` apart correlated by 1/e (white noise where it is 0)."""
    if len(noise.sd) != values.shape[2]:
        raise ValueError(f"tracker noise has {len(noise.sd)} sds for {values.shape[2]} signals")
    rng = np.random.default_rng(seed)
    step = np.exp(-1.0 / (noise.correlation_s * fps)) if noise.correlation_s > 0 else 0.0
    shocks = rng.standard_normal(values.shape)
    shocks[:, 1:] *= np.sqrt(1.0 - step * step)  # the first frame at the stationary sd, the rest its innovations
    error = lfilter([1.0], [1.0, -step], shocks, axis=1) * np.asarray(noise.sd)
    return (values + error).astype(np.float32)


def describe(values: np.ndarray, fps: float) -> np.ndarray:
    """The descriptors (`DESCRIPTORS`) of every signal of every clip: clips x (signals * descriptors), signal-major."""
    time = np.arange(values.shape[1]) / fps
    centred = time - time.mean()
    speed = np.diff(values, axis=1) * fps
    acceleration = np.diff(speed, axis=1) * fps
    low, median, high = np.percentile(values, [25, 50, 75], axis=1)
    columns = [values.mean(1), median, values.min(1), values.max(1), np.ptp(values, 1), values.std(1), high - low,
               np.tensordot(values, centred, axes=([1], [0])) / (centred ** 2).sum(), time[values.argmax(1)],
               np.abs(speed).mean(1), speed.max(1), speed.min(1), speed.std(1), np.abs(acceleration).mean(1),
               acceleration.std(1)]
    return np.stack(columns, axis=2).reshape(len(values), -1).astype(np.float32)


def descriptor_names(signals: Sequence[str]) -> list[str]:
    """The column names of `describe`'s output: `<signal>/<descriptor>`."""
    return [f"{signal}/{name}" for signal in signals for name in DESCRIPTORS]


def loso_predictions(features: np.ndarray, labels: np.ndarray, subjects: np.ndarray, forest: ForestSettings,
                     folds: int | None = None) -> np.ndarray:
    """Each clip's predicted label from a forest trained on every other subject's clips: leave one subject out, or
    (`folds`) the subjects dealt in name order into that many groups, one group left out at a time (a cheaper
    stand-in for a search)."""
    names, index = np.unique(subjects, return_inverse=True)
    groups = index if folds is None else index % folds
    predicted = np.empty_like(labels)
    for group in np.unique(groups):
        test = groups == group
        model = RandomForestClassifier(n_estimators=forest.trees, min_samples_leaf=forest.min_samples_leaf,
                                       max_samples=forest.max_samples, random_state=forest.seed, n_jobs=forest.jobs)
        model.fit(features[~test], labels[~test])
        predicted[test] = model.predict(features[test])
    return predicted


def subject_accuracies(labels: np.ndarray, predicted: np.ndarray, subjects: np.ndarray) -> np.ndarray:
    """Each subject's share of clips called right, subjects in sorted order."""
    names, index = np.unique(subjects, return_inverse=True)
    correct = np.bincount(index, weights=(labels == predicted).astype(float), minlength=len(names))
    return correct / np.bincount(index, minlength=len(names))
