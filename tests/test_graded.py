"""Graded metrics (pipeline/evaluation/graded.py): MAE, quadratic-weighted kappa, accuracy and macro-F1 equal
scikit-learn's on random tables, Spearman within subject equals scipy's per subject with the subjects that have none
counted, the subject-bootstrap interval holds the estimate and narrows with more subjects, and the level-ordered
confusion matrix is written as a table and a PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from sklearn.metrics import accuracy_score, cohen_kappa_score, f1_score, mean_absolute_error

from pipeline.evaluation.aggregation import ordinal_decision, pain_probability
from pipeline.evaluation.graded import (
    CONSTANT_SCORE,
    SINGLE_LEVEL,
    expected_level,
    graded_metrics,
    graded_table,
    level_confusion,
    spearman_within_subject,
    write_level_confusion,
)

K = 5
NAMES = ("BL1", "PA1", "PA2", "PA3", "PA4")


def graded_videos(n_subjects: int, videos_per_level: int, seed: int, noise: float = 1.0) -> pd.DataFrame:
    """Each subject's videos at every level; the called level is the true one plus rounded noise, clipped; the score
    the true level plus a person's offset and noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for subject in range(n_subjects):
        offset = rng.normal(0, 1)
        for level in range(K):
            for video in range(videos_per_level):
                rows.append({"subject_name": f"s{subject:03d}", "sample_name": f"{level}-{video}", "label": level,
                             "pred": int(np.clip(np.rint(level + rng.normal(0, noise)), 0, K - 1)),
                             "score": level + offset + rng.normal(0, noise), "fold": subject % 3})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(5))
def test_mae_kappa_accuracy_and_macro_f1_equal_scikit_learns_on_random_tables(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 200))
    videos = pd.DataFrame({"subject_name": rng.choice(["a", "b", "c", "d"], n), "label": rng.integers(0, K, n),
                           "pred": rng.integers(0, K, n) if seed % 2 else rng.integers(1, K - 1, n)})
    metrics = graded_metrics(videos, K, n_resamples=200)
    labels, called = videos["label"], videos["pred"]
    assert metrics["mae"] == pytest.approx(mean_absolute_error(labels, called))
    assert metrics["qwk"] == pytest.approx(cohen_kappa_score(labels, called, labels=range(K), weights="quadratic"))
    assert metrics["accuracy"] == pytest.approx(accuracy_score(labels, called))
    assert metrics["macro_f1"] == pytest.approx(f1_score(labels, called, average="macro", zero_division=0))


def test_spearman_within_subject_is_scipys_per_subject_and_counts_the_subjects_without_one() -> None:
    videos = graded_videos(6, 3, seed=1)
    one_level = pd.DataFrame({"subject_name": "x_one_level", "sample_name": ["u", "v"], "label": [2, 2],
                              "pred": [2, 1], "score": [0.1, 0.7], "fold": 0})
    constant = pd.DataFrame({"subject_name": "y_constant", "sample_name": ["u", "v", "w"], "label": [0, 1, 4],
                             "pred": [1, 1, 1], "score": [0.5, 0.5, 0.5], "fold": 0})
    result = spearman_within_subject(pd.concat([videos, one_level, constant], ignore_index=True))
    table = result.per_subject.set_index("subject_name")
    for subject, group in videos.groupby("subject_name"):
        assert table.loc[subject, "rho"] == pytest.approx(stats.spearmanr(group["label"], group["score"]).statistic)
        assert table.loc[subject, "status"] == "ok"
    assert table.loc["x_one_level", "status"] == SINGLE_LEVEL and np.isnan(table.loc["x_one_level", "rho"])
    assert table.loc["y_constant", "status"] == CONSTANT_SCORE
    assert (result.n_subjects, result.n_single_level, result.n_constant_score) == (6, 1, 1)
    assert result.mean == pytest.approx(table.loc[table["status"] == "ok", "rho"].mean())
    metrics = graded_metrics(pd.concat([videos, one_level, constant]), K, n_resamples=200)
    assert metrics["spearman_within_subject_n_single_level"] == 1  # reported beside the mean, not dropped silently
    assert metrics["spearman_within_subject"] == pytest.approx(result.mean)


def _width(metrics: dict[str, float], name: str) -> float:
    return metrics[f"{name}_ci95_high"] - metrics[f"{name}_ci95_low"]


def test_the_subject_bootstrap_interval_holds_the_estimate_and_narrows_with_more_subjects() -> None:
    few = graded_metrics(graded_videos(8, 2, seed=2), K, n_resamples=500)
    many = graded_metrics(graded_videos(80, 2, seed=2), K, n_resamples=500)
    for name in ("mae", "qwk", "accuracy", "macro_f1", "spearman_within_subject"):
        for metrics in (few, many):
            assert metrics[f"{name}_ci95_low"] <= metrics[name] <= metrics[f"{name}_ci95_high"], name
        assert _width(many, name) < _width(few, name), name
    one = graded_metrics(graded_videos(1, 2, seed=2), K)
    assert np.isfinite(one["mae"]) and np.isnan(one["mae_ci95_low"])  # one subject: no interval


def test_the_table_holds_pooled_and_per_fold_rows_and_bad_levels_name_the_row() -> None:
    videos = graded_videos(9, 2, seed=3)
    table = graded_table(videos, K, n_resamples=200)
    assert list(table["scope"].unique()) == ["pooled", "fold 0", "fold 1", "fold 2"]
    pooled = table[(table["scope"] == "pooled") & (table["metric"] == "mae")].iloc[0]
    assert pooled["value"] == pytest.approx(mean_absolute_error(videos["label"], videos["pred"]))
    assert (pooled["n_subjects"], pooled["n_videos"]) == (9, len(videos))
    fold = videos[videos["fold"] == 1]
    got = table[(table["scope"] == "fold 1") & (table["metric"] == "qwk")]["value"].iloc[0]
    assert got == pytest.approx(cohen_kappa_score(fold["label"], fold["pred"], labels=range(K), weights="quadratic"))
    bad = videos.copy()
    bad.loc[7, "pred"] = 5
    with pytest.raises(ValueError, match=r"pred=5 is not a level 0..4 in 1 row\(s\), the first row 7 \(s000/"):
        graded_metrics(bad, K)


def test_ordinal_decision_and_expected_level_read_level_probabilities() -> None:
    probs = np.array([[0.6, 0.2, 0.1, 0.05, 0.05], [0.1, 0.1, 0.1, 0.3, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert ordinal_decision(probs).tolist() == [0, 3, 2]  # the median level: P(level > k) > 0.5 counted
    np.testing.assert_allclose(expected_level(probs), probs @ np.arange(K))
    np.testing.assert_allclose(pain_probability(probs, 1), 1 - probs[:, 0])
    np.testing.assert_allclose(pain_probability(probs, 4), probs[:, 4])
    with pytest.raises(ValueError, match="pain level 5 outside 1..4"):
        pain_probability(probs, 5)


def test_the_level_ordered_confusion_is_written_as_a_table_and_a_png(tmp_path: Path) -> None:
    videos = pd.DataFrame({"label": [0, 0, 4, 4, 2], "pred": [0, 1, 4, 3, 2]})
    table = level_confusion(videos, NAMES)
    assert list(table.index) == list(NAMES) and list(table.columns) == [f"called_{n}" for n in NAMES]
    assert table.loc["PA4", "called_PA3"] == 1 and table.to_numpy().sum() == 5
    csv_path, png_path = write_level_confusion(videos, NAMES, tmp_path, "confusion_levels", title="five_class")
    assert pd.read_csv(csv_path).set_index("true").equals(table.rename_axis("true"))
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["confusion_levels.csv", "confusion_levels.png"]
