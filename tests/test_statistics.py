"""Subject-level statistics against cases small enough to work out by hand, and the paired test's error rate on a
seeded simulation of folds whose trained models move their test subjects together."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from pipeline.evaluation.metrics import calibration_metrics
from pipeline.evaluation.statistics import (
    calibration_intervals,
    holm,
    paired_permutation_test,
    paired_test,
    smallest_signed_rank_p,
    subject_bootstrap,
    subject_intervals,
    subject_scores,
)


def test_permutation_test_on_four_subjects_matches_the_enumeration() -> None:
    """Differences 2, 4, 6, -1 (sum 11). Of the 2**4 sign flips only (+,+,+,+) = 13 and (+,+,+,-) = 11 reach 11;
    by symmetry two reach -11: p = 4 / 16 = 0.25."""
    b = np.array([0.5, 0.5, 0.5, 0.5])
    a = b + np.array([2, 4, 6, -1])
    mean_difference, p_value = paired_permutation_test(a, b)
    assert mean_difference == pytest.approx(11 / 4)
    assert p_value == pytest.approx(4 / 16)
    # all four the same way: only (+,+,+,+) and (-,-,-,-) are as extreme, p = 2 / 16, the floor of four subjects
    assert paired_permutation_test(b + 1, b)[1] == pytest.approx(2 / 16) == smallest_signed_rank_p(4)
    assert paired_permutation_test(b, b) == (0.0, 1.0)


def test_identical_scores_give_p_one_and_keep_holms_family() -> None:
    """Two backbones with the same per-subject scores: p = 1, never NaN, so Holm still counts three tests
    (0.01 * 3 = 0.03, not 0.01 * 2 as a dropped NaN would give)."""
    same = np.array([0.5, 0.75, 1.0, 0.25])
    difference, p_same = paired_permutation_test(same, same.copy())
    assert (difference, p_same) == (0.0, 1.0)
    assert paired_permutation_test(np.array([0.9]), np.array([0.1]))[1] == 1.0  # one subject: both flips as extreme
    assert np.isnan(paired_permutation_test(np.array([np.nan]), np.array([0.1]))[1])  # nothing paired
    np.testing.assert_allclose(holm([0.01, 0.04, p_same]), [0.03, 0.08, 1.0])


def test_five_folds_cannot_reach_significance() -> None:
    assert smallest_signed_rank_p(5) == 0.0625 > 0.05
    assert smallest_signed_rank_p(6) < 0.05


def test_holm_by_hand() -> None:
    """p = 0.01, 0.04, 0.03: sorted times 3, 2, 1 -> 0.03, 0.06, 0.04, made non-decreasing -> 0.03, 0.06, 0.06."""
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    adjusted = holm([0.2, np.nan, 0.9])
    assert np.isnan(adjusted[1]) and adjusted[0] == pytest.approx(0.4) and adjusted[2] == pytest.approx(0.9)


def test_bootstrap_of_two_subjects_spans_both() -> None:
    """Two subjects, accuracies 1 and 0: a resample holds both (mean 0.5) half the time and one of them twice a
    quarter of the time each, so the 2.5 % and 97.5 % percentiles are exactly 0 and 1."""
    groups = [(np.array([1, 1]),), (np.array([0, 0, 0]),)]
    low, high = subject_bootstrap(groups, lambda correct: float(correct.mean()))
    assert (low, high) == (0.0, 1.0)
    assert subject_bootstrap(groups[:1], np.mean) != subject_bootstrap(groups[:1], np.mean)  # NaN: one subject


def test_bootstrap_interval_is_near_the_normal_one_and_repeatable() -> None:
    """Forty subjects: the percentile interval of the mean lies near mean +- 1.96 sd / sqrt(n), within [0, 1]."""
    values = np.random.default_rng(3).uniform(0.6, 1.0, 40)
    groups = [(np.array([v]),) for v in values]
    low, high = subject_bootstrap(groups, lambda x: float(x.mean()))
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
    assert low == pytest.approx(values.mean() - half, abs=0.01)
    assert high == pytest.approx(values.mean() + half, abs=0.01)
    assert subject_bootstrap(groups, lambda x: float(x.mean())) == (low, high)


def test_subject_scores_and_intervals() -> None:
    videos = pd.DataFrame({"subject_name": ["a"] * 4 + ["b"] * 4, "sample_name": list("abcdefgh"),
                           "label": [0, 0, 1, 1] * 2, "prob_PA4": [0.1, 0.6, 0.7, 0.9, 0.4, 0.2, 0.3, 0.8],
                           "decision": [0, 1, 1, 1, 0, 0, 0, 1]})
    videos["prob_BL1"] = 1 - videos["prob_PA4"]
    table = subject_scores(videos, ("BL1", "PA4"))
    assert table["accuracy_at_threshold"].tolist() == [0.75, 0.75]
    # b: of the four (pain, baseline) pairs only 0.3 < 0.4 is ranked wrong
    assert table["within_subject_auroc"].tolist() == [1.0, 0.75]
    result = subject_intervals(videos, ("BL1", "PA4"))
    assert result["accuracy_at_threshold"] == 0.75 == result["balanced_accuracy_at_threshold"]
    assert result["within_subject_auroc"] == 0.875
    # pain videos called pain: a 2 of 2, b 1 of 2 -> 3 / 4; baseline called baseline: a 1 of 2, b 2 of 2 -> 3 / 4
    assert result["sensitivity_at_threshold"] == 0.75 == result["specificity_at_threshold"]
    assert (result["within_subject_auroc_ci95_low"], result["within_subject_auroc_ci95_high"]) == (0.75, 1.0)


def test_the_paired_test_by_hand() -> None:
    """Differences 1, 3 (fold 0) and -1, 1 (fold 1): mean 1; the folds' summed deviations +2 and -2, so the variance of
    the mean is 2 / 1 * (4 + 4) / 4**2 = 1 on 1 degree of freedom: t = 1, p = 2 * P(T_1 > 1) = 0.5, and the interval
    1 +- t_{0.975, 1} = 1 +- 12.706."""
    test = paired_test(np.array([1.0, 3.0, -1.0, 1.0]), np.array([0, 0, 1, 1]))
    assert (test.mean_diff, test.standard_error, test.df, test.n_units, test.n_subjects) == (1.0, 1.0, 1.0, 2, 4)
    assert test.p_value == pytest.approx(0.5)
    assert (test.ci95_low, test.ci95_high) == pytest.approx((1 - 12.7062047, 1 + 12.7062047))
    same = paired_test(np.zeros(6), np.arange(6) % 3)
    assert (same.mean_diff, same.p_value) == (0.0, 1.0)  # identical scores: p = 1, never NaN (Holm keeps the test)
    one_fold = paired_test(np.array([0.1, 0.2, 0.3]), np.zeros(3))
    assert one_fold.n_units == 1 and np.isnan(one_fold.p_value) and one_fold.mean_diff == pytest.approx(0.2)


def test_equal_folds_give_the_t_test_of_the_fold_means_and_one_subject_a_fold_the_paired_t_test() -> None:
    """Five folds of 17 subjects: the p-value and interval are scipy's one-sample t-test of the five fold means (the
    test of the mean in a balanced random-effects model of fold and subject); with one subject a fold (leave one
    subject out) they are the paired t-test over subjects. The interval excludes 0 exactly when p < 0.05."""
    rng = np.random.default_rng(4)
    folds = np.repeat(np.arange(5), 17)
    differences = rng.normal(0.02, 0.1, 85) + rng.normal(0, 0.03, 5)[folds]
    test = paired_test(differences, folds)
    means = np.array([differences[folds == f].mean() for f in range(5)])
    expected = stats.ttest_1samp(means, 0.0)
    assert test.p_value == pytest.approx(expected.pvalue) and test.df == 4
    interval = expected.confidence_interval(0.95)
    assert (test.ci95_low, test.ci95_high) == pytest.approx((interval.low, interval.high))
    loso = paired_test(differences, np.arange(85))
    assert loso.p_value == pytest.approx(stats.ttest_1samp(differences, 0.0).pvalue) and loso.df == 84
    for result in (test, loso):
        assert (result.ci95_low > 0 or result.ci95_high < 0) == (result.p_value < 0.05)


def simulated_differences(rng: np.random.Generator, n_studies: int, fold_sd: float) -> tuple[np.ndarray, np.ndarray]:
    """Two copies of one algorithm on BioVid's kfold5 shape (87 subjects in folds of 18, 18, 17, 17, 17): each
    subject's accuracy difference is the binomial noise of its 10 videos plus its fold's model pair's shared luck
    (training and threshold), N(0, fold_sd) for all of that fold's subjects alike. No true difference."""
    folds = np.repeat(np.arange(5), [18, 18, 17, 17, 17])
    own = (rng.binomial(10, 0.6, (n_studies, 87, 2)) / 10.0) @ np.array([1.0, -1.0])
    return own + rng.normal(0, fold_sd, (n_studies, 5))[:, folds], folds


def test_with_large_fold_level_training_noise_the_fold_test_keeps_its_rate_and_the_subject_test_does_not() -> None:
    """Seeded simulation of the A/A comparison where each fold's trained models move its test subjects together
    (fold sd 0.08 against a subject sd of about 0.22): the within-subject permutation test, which takes the 87
    subjects as independent, rejects far more than 5 % at a raw 0.05; the paired test over subjects grouped by fold
    rejects at its level (its 95 % Clopper-Pearson interval holds 5 %). Without fold noise both keep the level."""
    rng = np.random.default_rng(2024)
    differences, folds = simulated_differences(rng, 400, fold_sd=0.08)
    zeros = np.zeros(87)
    new = np.array([paired_test(d, folds).p_value < 0.05 for d in differences])
    old = np.array([paired_permutation_test(d, zeros, n_resamples=499)[1] < 0.05 for d in differences])
    interval = stats.binomtest(int(new.sum()), len(new)).proportion_ci(method="exact")
    assert interval.low <= 0.05 <= interval.high and new.mean() < 0.08
    assert old.mean() > 0.15  # several times the nominal rate
    quiet, _ = simulated_differences(rng, 400, fold_sd=0.0)
    quiet_rate = np.mean([paired_test(d, folds).p_value < 0.05 for d in quiet])
    assert stats.binomtest(int(round(quiet_rate * 400)), 400).proportion_ci(method="exact").low <= 0.05 <= 0.08


def test_the_summed_counts_bootstrap_equals_resampling_the_videos_themselves() -> None:
    """subject_intervals sums the resampled subjects' confusion counts; resampling their videos and computing each
    metric from them with sklearn (`subject_bootstrap`, the same generator) gives the very same intervals, for two
    and five classes, with classes some subjects lack."""
    from sklearn.metrics import balanced_accuracy_score

    for seed, names in ((0, ("BL1", "PA4")), (1, ("BL1", "PA1", "PA2", "PA3", "PA4"))):
        rng = np.random.default_rng(seed)
        k = len(names)
        rows = [{"subject_name": f"s{s}", "label": int(rng.integers(0, k)), "decision": int(rng.integers(0, k)),
                 **dict(zip([f"prob_{n}" for n in names], rng.dirichlet(np.ones(k)), strict=True))}
                for s in range(9) for _ in range(int(rng.integers(1, 7)))]
        videos = pd.DataFrame(rows)
        fast = subject_intervals(videos, names, n_resamples=300)
        arrays = [(g["label"].to_numpy(), g["decision"].to_numpy()) for _, g in videos.groupby("subject_name")]
        slow = {
            "accuracy_at_threshold": subject_bootstrap(arrays, lambda y, c: float((y == c).mean()), n_resamples=300),
            "balanced_accuracy_at_threshold": subject_bootstrap(
                arrays, lambda y, c: float(balanced_accuracy_score(y, c)), n_resamples=300),
        }
        for metric, (low, high) in slow.items():
            assert (fast[f"{metric}_ci95_low"], fast[f"{metric}_ci95_high"]) == pytest.approx((low, high), abs=1e-12)


def test_calibration_intervals_are_the_subject_bootstrap_of_brier_and_ece() -> None:
    """calibration_intervals sums the resampled subjects' Brier terms and reliability-bin parts; resampling their
    videos and computing Brier and ECE from them (`calibration_metrics` through `subject_bootstrap`, the same
    generator) gives the very same intervals, for two and five classes. The values are calibration_metrics' of all
    videos and lie in their intervals; with every video one subject's there is nothing to resample."""
    for seed, names in ((0, ("BL1", "PA4")), (1, ("BL1", "PA1", "PA2", "PA3", "PA4"))):
        rng = np.random.default_rng(seed)
        k = len(names)
        rows = [{"subject_name": f"s{s}", "label": int(rng.integers(0, k)),
                 **dict(zip([f"prob_{n}" for n in names], rng.dirichlet(np.ones(k)), strict=True))}
                for s in range(9) for _ in range(int(rng.integers(1, 7)))]
        videos = pd.DataFrame(rows)
        columns = [f"prob_{n}" for n in names]
        fast = calibration_intervals(videos, names, n_resamples=300)
        assert {m: fast[m] for m in ("brier", "ece")} == pytest.approx(
            calibration_metrics(videos["label"].to_numpy(), videos[columns].to_numpy()), abs=1e-12)
        arrays = [(g["label"].to_numpy(), g[columns].to_numpy()) for _, g in videos.groupby("subject_name")]
        for metric in ("brier", "ece"):
            low, high = subject_bootstrap(arrays, lambda y, p, m=metric: calibration_metrics(y, p)[m],
                                          n_resamples=300)
            assert (fast[f"{metric}_ci95_low"], fast[f"{metric}_ci95_high"]) == pytest.approx((low, high), abs=1e-12)
            assert low <= fast[metric] <= high and low < high
        one = calibration_intervals(videos.assign(subject_name="s0"), names)
        assert one["brier"] == pytest.approx(fast["brier"])
        assert np.isnan(one["brier_ci95_low"]) and np.isnan(one["ece_ci95_high"])
