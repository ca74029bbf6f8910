"""Statistics over subjects: per-subject scores, subject-level bootstrap intervals, paired tests between backbones.

K-fold and leave-one-subject-out test every subject exactly once; a hold-out tests its test subjects only, once
each. Either way the pooled test videos of a cross-validation hold one score per tested subject, and two backbones
run on the same fold file are paired subject by subject. The interval of one backbone's pooled score is a subject
bootstrap (`scipy.stats.bootstrap`, each subject resampled with all of its videos).

The paired test of two backbones (`paired_test`) does not take the subjects as independent: the test subjects of one
fold were all scored by that fold's trained models, so whatever the models' training and threshold did (seed, the
validation subjects' luck) moves all of them alike; in kfold5 on BioVid about 17 subjects share one model pair, and a
test that swaps scores within subjects as if they were independent rejects two copies of one algorithm 8-13 % of the
time at a nominal 5 % (`make power EFFECT=aa`, docs/numbers.md). So the per-subject differences are grouped by the
fold that tested them, and the mean difference is tested with the folds' cluster-robust standard error on folds - 1
degrees of freedom; its interval comes from the same statistic. Five folds can never make a signed-rank test over
folds significant (its smallest exact two-sided p-value is 2 / 2**5 = 0.0625); the t-test on fold-grouped subject
differences can, since each fold's mean rests on its subjects. `paired_permutation_test` is the earlier
within-subject sign-flip test, kept as the reference `make power` measures against. Holm's step-down adjustment
(`holm`) is applied over the primary metric's tests, one a pair of backbones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import optimize, stats
from sklearn.metrics import roc_auc_score

from pipeline.evaluation.metrics import CALIBRATION_BINS, calibration_terms, expected_calibration_error

CONFIDENCE = 0.95
N_BOOTSTRAP = 2000
N_PERMUTATIONS = 9999  # above 2**13 subjects' sign flips; fewer subjects are enumerated exactly
RANDOM_STATE = 0  # fixed: the same predictions give the same interval and p-value on every run
# The subject-level metrics: pooled over the resampled subjects' videos (the first two), mean over subjects (AUROC).
SUBJECT_METRICS = ("accuracy_at_threshold", "balanced_accuracy_at_threshold", "within_subject_auroc")
# Calibration of the pooled video probabilities, with the same subject bootstrap (`calibration_intervals`)
CALIBRATION_METRICS = ("brier", "ece")


def decisions(videos: pd.DataFrame) -> np.ndarray:
    """The class each video was called: the fold's `decision` column (validation threshold), else argmax `pred`
    (`decided_by` names which, so a run without decisions is never labelled "at threshold")."""
    column = "decision" if "decision" in videos.columns else "pred"
    return videos[column].to_numpy(dtype=int)


def decided_by(videos: pd.DataFrame) -> str:
    """How the videos' calls were made: 'threshold' (each fold's validation threshold; argmax for more than two
    classes) or 'argmax' (a run that logged no `decision` column)."""
    return "threshold" if "decision" in videos.columns else "argmax"


def within_subject_auroc(labels: np.ndarray, probs: np.ndarray) -> float:
    """AUROC among one subject's videos (binary: class 1's probability; multiclass: macro one-vs-rest over the
    classes present); NaN with fewer than two classes. One model's scores on one person: no scale mixing."""
    present = np.unique(labels)
    if len(present) < 2:
        return float("nan")
    if probs.shape[1] == 2:
        return float(roc_auc_score(labels, probs[:, 1]))
    return float(np.mean([roc_auc_score(labels == c, probs[:, c]) for c in present]))


def seed_mean_auroc(group: pd.DataFrame, prob_columns: list[str]) -> float:
    """One subject's within-subject AUROC; with a `seed` column, per training seed (one model's scores each), then
    averaged over the seeds where it is defined."""
    parts = [part for _, part in group.groupby("seed")] if "seed" in group.columns else [group]
    values = [within_subject_auroc(part["label"].to_numpy(dtype=int), part[prob_columns].to_numpy(float))
              for part in parts]
    finite = [value for value in values if np.isfinite(value)]
    return float(np.mean(finite)) if finite else float("nan")


def subject_scores(videos: pd.DataFrame, class_names: Sequence[str], auroc: bool = True) -> pd.DataFrame:
    """One row per subject of the pooled test videos: videos, correct calls, and the three subject metrics (without
    `auroc`, the within-subject AUROC is left out: NaN, and seconds fewer in a simulation of many studies)."""
    prob_columns = [f"prob_{name}" for name in class_names]
    videos = videos.assign(_decision=decisions(videos))
    rows = []
    for subject, group in videos.groupby("subject_name", sort=True):
        labels, called = group["label"].to_numpy(dtype=int), group["_decision"].to_numpy()
        recalls = [float((called[labels == c] == c).mean()) for c in np.unique(labels)]
        rows.append({"subject_name": subject, "n_videos": len(group), "n_correct": int((called == labels).sum()),
                     "accuracy_at_threshold": float((called == labels).mean()),
                     "balanced_accuracy_at_threshold": float(np.mean(recalls)),
                     "within_subject_auroc": seed_mean_auroc(group, prob_columns) if auroc else float("nan")})
    return pd.DataFrame(rows)


def subject_bootstrap(groups: Sequence[tuple[np.ndarray, ...]], statistic: Callable[..., float],
                      n_resamples: int = N_BOOTSTRAP, random_state: int = RANDOM_STATE,
                      confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile interval of `statistic` over subjects drawn with replacement, each bringing all of its rows.

    `groups` holds one tuple of arrays per subject; a resample concatenates its subjects' arrays component-wise
    and hands them to `statistic`. Percentiles of resampled values of a share stay inside [0, 1], unlike mean +- sd.
    NaN with fewer than two subjects.
    """
    width = len(groups[0]) if groups else 0

    def on_subjects(indices: np.ndarray) -> float:
        chosen = [groups[int(i)] for i in indices]
        return statistic(*(np.concatenate([g[k] for g in chosen]) for k in range(width)))

    return _over_subjects(len(groups), on_subjects, False, n_resamples, random_state, confidence)


def _over_subjects(n_subjects: int, on_subjects: Callable, vectorized: bool, n_resamples: int, random_state: int,
                   confidence: float) -> tuple[float, float]:
    """Percentile interval of `on_subjects(indices)` over subject indices drawn with replacement by
    `scipy.stats.bootstrap` (`vectorized`: it takes every resample at once, indices of shape (resamples, subjects)).
    NaN with fewer than two subjects."""
    if n_subjects < 2:
        return float("nan"), float("nan")
    result = stats.bootstrap((np.arange(n_subjects),), lambda indices, axis=-1: on_subjects(indices),
                             vectorized=vectorized, n_resamples=n_resamples, confidence_level=confidence,
                             method="percentile", rng=np.random.default_rng(random_state))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def _count_bootstrap(values: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray],
                     n_resamples: int = N_BOOTSTRAP, random_state: int = RANDOM_STATE,
                     confidence: float = CONFIDENCE) -> tuple[float, float]:
    """`subject_bootstrap`, vectorised, for arrays of one entry per subject (`values[i]`: subject i's confusion
    counts, or its one value): `statistic` gets `values` indexed by all resamples at once (leading axes: resample,
    subject) and returns one value per resample. The same draws as `subject_bootstrap`; milliseconds, not seconds."""
    return _over_subjects(len(values), lambda indices: statistic(values[np.asarray(indices, dtype=int)]), True,
                          n_resamples, random_state, confidence)


def _confusions(labels: np.ndarray, called: np.ndarray, subjects: np.ndarray, n_classes: int) -> np.ndarray:
    """(subjects, true class, called class) counts of videos, subjects in sorted order."""
    _, subject_index = np.unique(subjects, return_inverse=True)
    counts = np.zeros((subject_index.max() + 1, n_classes, n_classes))
    np.add.at(counts, (subject_index, labels, called), 1)
    return counts


def _recalls(confusion: np.ndarray) -> np.ndarray:
    """Per-class recall of summed confusions (..., k, k): NaN for a class without videos."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.diagonal(confusion, axis1=-2, axis2=-1) / confusion.sum(axis=-1)


def _accuracy(picked: np.ndarray) -> np.ndarray:
    confusion = picked.sum(axis=-3)
    return np.trace(confusion, axis1=-2, axis2=-1) / confusion.sum(axis=(-2, -1))


def _balanced(picked: np.ndarray) -> np.ndarray:
    """Balanced accuracy as sklearn computes it: the mean recall over the classes that have videos."""
    recalls = _recalls(picked.sum(axis=-3))
    present = np.isfinite(recalls)
    return np.where(present, recalls, 0.0).sum(axis=-1) / present.sum(axis=-1)


def _recall_of(cls: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda picked: _recalls(picked.sum(axis=-3))[..., cls]


def _nanmean_last(picked: np.ndarray) -> np.ndarray:
    """Mean over the resampled subjects' values, NaN where none is defined."""
    finite = np.isfinite(picked)
    with np.errstate(invalid="ignore"):
        return np.where(finite, picked, 0.0).sum(axis=-1) / finite.sum(axis=-1)


def subject_intervals(videos: pd.DataFrame, class_names: Sequence[str], metrics: Sequence[str] | None = None,
                      **options) -> dict[str, float]:
    """Each subject metric (or only `metrics`) with its subject-bootstrap interval: `<metric>`, `<metric>_ci95_low`,
    `_ci95_high`. Each metric's bootstrap draws from its own generator, so a subset gives the same values.

    Accuracy and balanced accuracy at the threshold are pooled over the videos (as a paper states them); the
    AUROC is the mean of the within-subject AUROCs (subjects without both classes left out). A resample of
    subjects sums their confusion counts, so the bootstrap needs no video table per resample.
    """
    called = decisions(videos)
    per_subject = subject_scores(videos, class_names)
    labels = videos["label"].to_numpy(dtype=int)
    n_classes = max(len(class_names), int(labels.max(initial=0)) + 1, int(called.max(initial=0)) + 1)
    confusions = _confusions(labels, called, videos["subject_name"].to_numpy(), n_classes)
    aurocs = per_subject["within_subject_auroc"].to_numpy(dtype=float)
    pooled = confusions.sum(axis=0)
    binary = len(class_names) == 2
    nan = float("nan")
    estimates = {
        "accuracy_at_threshold": (float(_accuracy(confusions)), confusions, _accuracy),
        "balanced_accuracy_at_threshold": (float(_balanced(confusions)), confusions, _balanced),
        "within_subject_auroc": (float(_nanmean_last(aurocs)), aurocs, _nanmean_last),
        # two classes: recall of pain (sensitivity) and of baseline (specificity), pooled over the videos
        "sensitivity_at_threshold": (float(_recalls(pooled)[1]) if binary else nan, confusions, _recall_of(1)),
        "specificity_at_threshold": (float(_recalls(pooled)[0]) if binary else nan, confusions, _recall_of(0)),
    }
    result = {}
    for name, (value, values, statistic) in estimates.items():
        if metrics is not None and name not in metrics:
            continue
        low, high = _count_bootstrap(values, statistic, **options) if np.isfinite(value) else (np.nan, np.nan)
        result.update({name: value, f"{name}_ci95_low": low, f"{name}_ci95_high": high})
    return result


def calibration_intervals(videos: pd.DataFrame, class_names: Sequence[str], n_bins: int = CALIBRATION_BINS,
                          **options) -> dict[str, float]:
    """Brier score and ECE of the pooled videos (`metrics.calibration_metrics`) with their subject-bootstrap
    intervals: `brier`, `brier_ci95_low`, `brier_ci95_high`, `ece`, ...; the draws of `subject_intervals`.

    A resample of subjects sums its subjects' parts (videos and Brier terms; per reliability bin videos,
    confidences and outcomes), so it needs no video table per resample. The videos of a cross-validation come from
    its fold models, each with its own probability scale: pooled calibration mixes those models, and is no fold
    model's calibration.
    """
    prob_columns = [f"prob_{name}" for name in class_names]
    brier, index, confidence, outcome = calibration_terms(videos["label"].to_numpy(dtype=int),
                                                          videos[prob_columns].to_numpy(dtype=float), n_bins)
    _, subject = np.unique(videos["subject_name"].to_numpy(), return_inverse=True)
    n_subjects = int(subject.max()) + 1 if len(subject) else 0
    totals = np.zeros((n_subjects, 2))  # per subject: videos, summed Brier terms
    np.add.at(totals, (subject, 0), 1.0)
    np.add.at(totals, (subject, 1), brier)
    bins = np.zeros((n_subjects, 3, n_bins))  # per subject and bin: videos, summed confidences, summed outcomes
    for part, weights in enumerate((np.ones(len(index)), confidence, outcome)):
        np.add.at(bins, (subject, part, index), weights)

    def brier_of(picked: np.ndarray) -> np.ndarray:
        summed = picked.sum(axis=-2)
        return summed[..., 1] / summed[..., 0]

    def ece_of(picked: np.ndarray) -> np.ndarray:
        summed = picked.sum(axis=-3)
        return expected_calibration_error(summed[..., 0, :], summed[..., 1, :], summed[..., 2, :])

    result = {}
    for name, values, statistic in (("brier", totals, brier_of), ("ece", bins, ece_of)):
        value = float(statistic(values)) if n_subjects else float("nan")
        low, high = _count_bootstrap(values, statistic, **options) if np.isfinite(value) else (np.nan, np.nan)
        result.update({name: value, f"{name}_ci95_low": low, f"{name}_ci95_high": high})
    return result


def paired_permutation_test(a: np.ndarray, b: np.ndarray, n_resamples: int = N_PERMUTATIONS,
                            random_state: int = RANDOM_STATE) -> tuple[float, float]:
    """Mean of (a - b) over subjects and its two-sided p-value from swapping a and b within subjects.

    With 2**n <= n_resamples the 2**n swaps are enumerated exactly, so small cases can be checked by hand. Identical
    scores (every difference 0) and a single subject give p = 1, which is what every swap says (each is as extreme
    as the observed one): never NaN, which would drop the test from Holm's family and shrink it. NaN only without
    any subject both have.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if len(a) == 0:
        return float("nan"), float("nan")
    if len(a) < 2 or np.all(a == b):
        return float(np.mean(a - b)), 1.0

    def mean_difference(x: np.ndarray, y: np.ndarray, axis: int) -> np.ndarray:
        return np.mean(x - y, axis=axis)

    result = stats.permutation_test((a, b), mean_difference, permutation_type="samples", vectorized=True,
                                    n_resamples=n_resamples, alternative="two-sided",
                                    rng=np.random.default_rng(random_state))
    return float(np.mean(a - b)), float(result.pvalue)


def minimum_detectable_effect(standard_error: float, df: float, alpha: float, power: float = 0.8) -> float:
    """The smallest true mean difference the two-sided t-test of `paired_test` (level `alpha`, `df` degrees of freedom,
    this standard error of the mean difference) detects with probability `power`: delta with P(|T| > t_{1-alpha/2})
    = power for T non-central t with non-centrality delta / standard_error (exact, not the normal approximation,
    which understates it on a few degrees of freedom: 5 folds give 4). NaN without a standard error or degrees of
    freedom; 0 when every difference is equal (standard error 0)."""
    if not (np.isfinite(standard_error) and np.isfinite(df) and df >= 1):
        return float("nan")
    if standard_error == 0:
        return 0.0
    critical = stats.t.ppf(1 - alpha / 2, df)

    def shortfall(ncp: float) -> float:
        # P(T < -c) for non-centrality ncp is P(T > c) for -ncp: scipy's nct.cdf returns NaN on some of these lower
        # tails (df 1, ncp near 15), its sf does not
        return float(stats.nct.sf(critical, df, ncp) + stats.nct.sf(critical, df, -ncp)) - power

    upper = critical + stats.t.ppf(power, df) + 1.0
    while shortfall(upper) < 0:  # the normal approximation plus one is nearly always above it already
        upper *= 2
    return float(optimize.brentq(shortfall, 0.0, upper, xtol=1e-10) * standard_error)


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error over all the tests given); NaN stays NaN."""
    p = np.asarray(p_values, dtype=float)
    adjusted = np.full_like(p, np.nan)
    tested = np.flatnonzero(np.isfinite(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    m = len(order)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def smallest_signed_rank_p(n: int) -> float:
    """The smallest two-sided p-value an exact signed-rank (or sign-flip) test over n pairs can reach: 2 / 2**n."""
    return 2.0 / 2**n if n > 0 else 1.0


@dataclass(frozen=True)
class PairedTest:
    """One paired test over subjects whose differences are grouped in units that share a trained model pair (the
    folds): the mean difference over subjects, its two-sided p-value and its interval, both from one t statistic."""

    mean_diff: float
    ci95_low: float
    ci95_high: float
    p_value: float
    standard_error: float
    df: float  # units - 1
    n_subjects: int
    n_units: int


def paired_test(differences: np.ndarray, units: np.ndarray, confidence: float = CONFIDENCE) -> PairedTest:
    """The mean per-subject difference a - b and its t-test with the units' cluster-robust standard error.

    `units[i]` is the unit subject i's difference belongs to: the fold that tested it, whose trained models (of every
    seed) scored all of that fold's test subjects, so whatever their training and threshold did moves those subjects
    alike. The variance of the mean is estimated from the units' summed deviations, sum_u (sum_{i in u} (d_i -
    mean))^2 * U / (U - 1) / n^2, on U - 1 degrees of freedom: with equal units it is the one-sample t-test of the
    U unit means (what a random-effects model of fold and subject gives for the mean of a balanced design), with one
    subject a unit (leave one subject out) the paired t-test over subjects. The p-value and the interval come from the
    same statistic, so the interval excludes 0 exactly when p < 1 - `confidence`. Identical scores give p = 1 (never
    NaN, which would drop the test from Holm's family); NaN differences are left out; NaN throughout with fewer than
    two units.
    """
    d = np.asarray(differences, dtype=float)
    unit = np.asarray(units)
    keep = np.isfinite(d)
    d, unit = d[keep], unit[keep]
    n = len(d)
    _, index = np.unique(unit, return_inverse=True)
    n_units = int(index.max()) + 1 if n else 0
    nan = float("nan")
    if n_units < 2:
        return PairedTest(float(d.mean()) if n else nan, nan, nan, nan, nan, nan, n, n_units)
    mean = float(d.mean())
    sums = np.bincount(index, weights=d - mean)
    se = float(np.sqrt(n_units / (n_units - 1) * np.sum(sums**2)) / n)
    df = float(n_units - 1)
    half = float(stats.t.ppf(0.5 + confidence / 2, df) * se)
    if se == 0:
        p_value = 1.0 if mean == 0 else 0.0
    else:
        p_value = float(2 * stats.t.sf(abs(mean) / se, df))
    return PairedTest(mean, mean - half, mean + half, p_value, se, df, n, n_units)


def common_videos(videos: Mapping[str, pd.DataFrame]) -> tuple[dict[str, pd.DataFrame], pd.DataFrame]:
    """Each CV's pooled test videos restricted to the videos (subject_name, sample_name) that every CV tested: how
    CVs that tested different videos are paired (a personalised CV's reference recordings left its test set, so
    they are left out of both). The record holds, per CV, its tested videos, the common ones and those dropped."""
    keys = {label: pd.MultiIndex.from_frame(table[["subject_name", "sample_name"]]) for label, table in videos.items()}
    indexes = [index.unique() for index in keys.values()]
    shared = indexes[0]
    for index in indexes[1:]:
        shared = shared.intersection(index)
    restricted, record = {}, []
    for label, table in videos.items():
        restricted[label] = table[keys[label].isin(shared)].reset_index(drop=True)
        tested = keys[label].nunique()
        record.append({"cv": label, "n_videos": tested, "n_common_videos": len(shared),
                       "n_dropped_videos": tested - len(shared)})
    return restricted, pd.DataFrame(record, columns=["cv", "n_videos", "n_common_videos", "n_dropped_videos"])
