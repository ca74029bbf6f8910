"""Metrics on hand-built inputs whose answers the tests derive independently (loops, pair counts, raw counts)."""

from __future__ import annotations

import itertools
import math

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from pipeline.evaluation.metrics import (
    aggregate_videos,
    classification_metrics,
    confusion,
    evaluate_predictions,
    per_subject_accuracy,
    plot_confusion,
    plot_roc,
    plot_training_curves,
    summarize_folds,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLASSES = ("BL1", "PA4")


def random_frames(seed: int, n_classes: int = 2, n_subjects: int = 3, videos_per_subject: int = 4) -> pd.DataFrame:
    """Frames of several videos with a random number of frames each and normalised random probabilities."""
    rng = np.random.default_rng(seed)
    rows = []
    for subject in range(n_subjects):
        for video in range(videos_per_subject):
            label = int(rng.integers(n_classes))
            for _ in range(int(rng.integers(1, 7))):
                probs = rng.random(n_classes)
                probs /= probs.sum()
                rows.append(
                    {
                        "subject_name": f"s{subject}",
                        "sample_name": f"s{subject}-v{video}",
                        "label": label,
                        **{f"prob_c{c}": probs[c] for c in range(n_classes)},
                    }
                )
    return pd.DataFrame(rows).sample(frac=1.0, random_state=seed).reset_index(drop=True)


def expected_video_probs(frames: pd.DataFrame, method: str, k: int) -> dict[tuple[str, str], np.ndarray]:
    """Aggregation written as plain loops over each video's frames."""
    columns = [c for c in frames.columns if c.startswith("prob_")]
    expected = {}
    for key in set(zip(frames["subject_name"], frames["sample_name"], strict=True)):
        rows = frames[(frames["subject_name"] == key[0]) & (frames["sample_name"] == key[1])]
        values = []
        for column in columns:
            column_values = sorted(rows[column].tolist(), reverse=True)
            if method == "mean":
                values.append(sum(column_values) / len(column_values))
            elif method == "max":
                values.append(column_values[0])
            else:
                top = column_values[:k]
                values.append(sum(top) / len(top))
        values = np.array(values)
        expected[key] = values if method == "mean" else values / values.sum()
    return expected


@pytest.mark.parametrize("method,k", [("mean", 3), ("max", 3), ("topk", 1), ("topk", 3), ("topk", 50)])
def test_aggregate_videos_matches_loops(method: str, k: int) -> None:
    frames = random_frames(seed=1, n_classes=3)
    videos = aggregate_videos(frames, method=method, k=k)
    expected = expected_video_probs(frames, method, k)
    assert len(videos) == len(expected)
    columns = ["prob_c0", "prob_c1", "prob_c2"]
    assert list(videos.columns) == ["subject_name", "sample_name", "label", *columns, "pred", "n_frames"]
    for row in videos.itertuples(index=False):
        key = (row.subject_name, row.sample_name)
        got = np.array([getattr(row, c) for c in columns])
        np.testing.assert_allclose(got, expected[key], rtol=1e-12)
        assert row.pred == int(np.argmax(expected[key]))
        source = frames[(frames["subject_name"] == key[0]) & (frames["sample_name"] == key[1])]
        assert row.n_frames == len(source)
        assert row.label == source["label"].iloc[0]
    np.testing.assert_allclose(videos[columns].sum(axis=1), 1.0, rtol=1e-12)


def test_topk_one_equals_max() -> None:
    frames = random_frames(seed=2)
    pd.testing.assert_frame_equal(aggregate_videos(frames, "topk", k=1), aggregate_videos(frames, "max", k=3))


def test_aggregate_small_hand_example() -> None:
    frames = pd.DataFrame(
        {
            "subject_name": ["a"] * 4,
            "sample_name": ["a-1"] * 4,
            "label": [1] * 4,
            "prob_BL1": [0.9, 0.2, 0.4, 0.1],
            "prob_PA4": [0.1, 0.8, 0.6, 0.9],
        }
    )
    mean = aggregate_videos(frames, "mean", 3).iloc[0]
    assert mean["prob_BL1"] == pytest.approx(0.4) and mean["prob_PA4"] == pytest.approx(0.6)
    assert mean["pred"] == 1
    top2 = aggregate_videos(frames, "topk", k=2).iloc[0]
    # top-2 BL1: (0.9 + 0.4) / 2 = 0.65, top-2 PA4: (0.9 + 0.8) / 2 = 0.85, renormalised over 1.5.
    assert top2["prob_BL1"] == pytest.approx(0.65 / 1.5) and top2["prob_PA4"] == pytest.approx(0.85 / 1.5)


def test_conflicting_labels_name_the_video() -> None:
    frames = random_frames(seed=3)
    first = frames.iloc[0]
    same_video = (frames["subject_name"] == first["subject_name"]) & (frames["sample_name"] == first["sample_name"])
    frames = pd.concat([frames, frames[same_video].head(1).assign(label=1 - int(first["label"]))], ignore_index=True)
    with pytest.raises(ValueError, match=f"{first['subject_name']}/{first['sample_name']}"):
        aggregate_videos(frames, "mean", 3)


def test_aggregate_rejects_unknown_method_and_missing_columns() -> None:
    frames = random_frames(seed=4)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate_videos(frames, "median", 3)
    with pytest.raises(ValueError, match="label"):
        aggregate_videos(frames.drop(columns=["label"]), "mean", 3)


def pairwise_auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUROC as the share of (positive, negative) pairs ranked correctly, ties counting one half."""
    positives = scores[labels == 1]
    negatives = scores[labels == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


def test_binary_metrics_from_first_principles() -> None:
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, size=60)
    positive = np.round(rng.random(60), 2)  # rounding makes ties
    probs = np.stack([1 - positive, positive], axis=1)
    result = classification_metrics(labels, probs)

    preds = probs.argmax(axis=1)
    true_positive = np.sum((preds == 1) & (labels == 1))
    false_positive = np.sum((preds == 1) & (labels == 0))
    false_negative = np.sum((preds == 0) & (labels == 1))
    recall_0 = np.sum((preds == 0) & (labels == 0)) / np.sum(labels == 0)
    recall_1 = true_positive / np.sum(labels == 1)
    assert result["accuracy"] == pytest.approx(np.mean(preds == labels))
    assert result["balanced_accuracy"] == pytest.approx((recall_0 + recall_1) / 2)
    assert result["f1"] == pytest.approx(2 * true_positive / (2 * true_positive + false_positive + false_negative))
    assert result["auroc"] == pytest.approx(pairwise_auroc(labels, positive))
    assert result["auroc"] == pytest.approx(roc_auc_score(labels, positive))


def test_multiclass_auroc_is_macro_one_vs_rest() -> None:
    rng = np.random.default_rng(6)
    labels = np.tile(np.arange(5), 12)
    probs = rng.random((60, 5))
    probs /= probs.sum(axis=1, keepdims=True)
    result = classification_metrics(labels, probs)
    by_hand = np.mean([pairwise_auroc((labels == c).astype(int), probs[:, c]) for c in range(5)])
    assert result["auroc"] == pytest.approx(by_hand)
    assert result["auroc"] == pytest.approx(roc_auc_score(labels, probs, multi_class="ovr", average="macro"))
    preds = probs.argmax(axis=1)
    f1_per_class = []
    for c in range(5):
        tp = np.sum((preds == c) & (labels == c))
        denominator = np.sum(preds == c) + np.sum(labels == c)
        f1_per_class.append(2 * tp / denominator if denominator else 0.0)
    assert result["f1"] == pytest.approx(np.mean(f1_per_class))


def test_single_class_gives_nan_auroc_not_an_error() -> None:
    labels = np.zeros(5, dtype=int)
    probs = np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    result = classification_metrics(labels, probs)
    assert math.isnan(result["auroc"])
    assert result["accuracy"] == pytest.approx(4 / 5)
    assert result["balanced_accuracy"] == pytest.approx(4 / 5)  # recall of the only class present
    five_class = classification_metrics(np.full(4, 2), np.full((4, 5), 0.2))
    assert math.isnan(five_class["auroc"])


def test_classification_metrics_rejects_bad_shapes_and_labels() -> None:
    with pytest.raises(ValueError, match="shape"):
        classification_metrics(np.array([0, 1]), np.array([0.2, 0.8]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        classification_metrics(np.array([0, 2]), np.full((2, 2), 0.5))


def test_confusion_counts() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2])
    preds = np.array([0, 1, 1, 2, 0, 2])
    expected = np.zeros((4, 4), dtype=int)
    for true, predicted in zip(labels, preds, strict=True):
        expected[true, predicted] += 1
    np.testing.assert_array_equal(confusion(labels, preds, 4), expected)
    with pytest.raises(ValueError, match="preds"):
        confusion(labels, np.array([0, 1, 1, 2, 0, 4]), 4)


def test_per_subject_accuracy_with_and_without_pred() -> None:
    table = pd.DataFrame(
        {
            "subject_name": ["b", "a", "a", "b", "a"],
            "label": [1, 0, 1, 1, 0],
            "prob_BL1": [0.3, 0.8, 0.6, 0.9, 0.4],
            "prob_PA4": [0.7, 0.2, 0.4, 0.1, 0.6],
        }
    )
    result = per_subject_accuracy(table)
    assert result["subject_name"].tolist() == ["a", "b"]
    assert result["n"].tolist() == [3, 2]
    np.testing.assert_allclose(result["accuracy"], [1 / 3, 1 / 2])
    with_pred = per_subject_accuracy(table.assign(pred=[1, 0, 1, 1, 0]))
    np.testing.assert_allclose(with_pred["accuracy"], [1.0, 1.0])


def test_evaluate_predictions_ties_the_pieces_together() -> None:
    frames = random_frames(seed=7).rename(columns={"prob_c0": "prob_BL1", "prob_c1": "prob_PA4"})
    frames["extra"] = "ignored"
    result = evaluate_predictions(frames, CLASSES, aggregation="topk", k=2)
    videos = aggregate_videos(frames[["subject_name", "sample_name", "label", "prob_BL1", "prob_PA4"]], "topk", 2)
    pd.testing.assert_frame_equal(result.video_predictions, videos)
    assert result.video_metrics == classification_metrics(
        videos["label"].to_numpy(), videos[["prob_BL1", "prob_PA4"]].to_numpy()
    )
    assert result.frame_metrics["accuracy"] == pytest.approx(
        np.mean(frames[["prob_BL1", "prob_PA4"]].to_numpy().argmax(axis=1) == frames["label"])
    )
    assert result.confusion_frame.sum() == len(frames)
    assert result.confusion_video.sum() == len(videos)
    assert result.per_subject["n"].sum() == len(videos)
    with pytest.raises(ValueError, match="prob_PA1"):
        evaluate_predictions(frames, ("BL1", "PA1"), "mean", 3)


def test_summarize_folds_ignores_nan() -> None:
    folds = [{"auroc": 0.6, "accuracy": 0.5}, {"auroc": float("nan"), "accuracy": 0.7}, {"auroc": 0.8, "accuracy": 0.9}]
    summary = summarize_folds(folds)
    assert summary["auroc_mean"] == pytest.approx(0.7)
    assert summary["auroc_std"] == pytest.approx(math.sqrt(((0.6 - 0.7) ** 2 + (0.8 - 0.7) ** 2) / 1))
    assert summary["accuracy_mean"] == pytest.approx(0.7)
    assert summary["accuracy_std"] == pytest.approx(math.sqrt((0.04 + 0 + 0.04) / 2))
    single = summarize_folds([{"auroc": 0.55}])
    assert single == {"auroc_mean": pytest.approx(0.55), "auroc_std": 0.0}
    assert math.isnan(summarize_folds([{"auroc": float("nan")}])["auroc_mean"])


def assert_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    assert not list(path.parent.glob(f".{path.stem}.*")), "temporary file left behind"


def test_plots_write_valid_pngs(tmp_path) -> None:
    plot_confusion(np.array([[5, 1], [2, 7]]), CLASSES, tmp_path / "confusion.png", title="fold 0")
    assert_png(tmp_path / "confusion.png")
    rng = np.random.default_rng(8)
    plot_roc(rng.integers(0, 2, 40), rng.random(40), tmp_path / "roc.png", title="fold 0")
    assert_png(tmp_path / "roc.png")
    plot_roc(np.zeros(5, dtype=int), rng.random(5), tmp_path / "roc_one_class.png")
    assert_png(tmp_path / "roc_one_class.png")
    # Lightning CSVLogger style: step rows carry train loss, epoch-end rows carry validation values.
    history = pd.DataFrame(
        {
            "epoch": [0, 0, 1, 1, 2, 2],
            "step": [10, 10, 20, 20, 30, 30],
            "train/loss": [0.9, np.nan, 0.7, np.nan, 0.5, np.nan],
            "val/loss": [np.nan, 0.95, np.nan, 0.8, np.nan, 0.75],
            "val/auroc": [np.nan, 0.55, np.nan, 0.62, np.nan, 0.7],
        }
    )
    plot_training_curves(history, tmp_path / "curves" / "training.png")
    assert_png(tmp_path / "curves" / "training.png")
    with pytest.raises(ValueError, match="loss"):
        plot_training_curves(history[["epoch", "step"]], tmp_path / "empty.png")


def test_plot_confusion_checks_shape(tmp_path) -> None:
    with pytest.raises(ValueError, match="3 class names"):
        plot_confusion(np.eye(2), ("a", "b", "c"), tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_brier_and_ece_against_values_worked_by_hand(tmp_path) -> None:
    """Pain probabilities 0.1, 0.4, 0.8, 0.9 for labels 0, 1, 1, 0.
    Brier: (0.1^2 + 0.6^2 + 0.2^2 + 0.9^2) / 4 = (0.01 + 0.36 + 0.04 + 0.81) / 4 = 0.305.
    ECE, ten bins: each video alone in its bin, |frequency - probability| = 0.1, 0.6, 0.2, 0.9, each weighing 1/4:
    1.8 / 4 = 0.45."""
    from pipeline.evaluation.metrics import calibration_metrics, plot_reliability, reliability_bins

    pain = np.array([0.1, 0.4, 0.8, 0.9])
    labels = np.array([0, 1, 1, 0])
    probs = np.column_stack([1 - pain, pain])
    result = calibration_metrics(labels, probs)
    assert result["brier"] == pytest.approx(0.305) and result["ece"] == pytest.approx(0.45)
    # calibrated: four videos at 0.25, one of them pain -> ECE 0; Brier (3 * 0.25^2 + 0.75^2) / 4 = 0.1875
    quarter = np.full(4, 0.25)
    calibrated = calibration_metrics(np.array([0, 0, 0, 1]), np.column_stack([1 - quarter, quarter]))
    assert calibrated == pytest.approx({"brier": 0.1875, "ece": 0.0})
    counts, mean_probability, frequency = reliability_bins(np.array([0, 0, 0, 1]), np.column_stack([1 - quarter,
                                                                                                      quarter]))
    assert counts[2] == 4 and counts.sum() == 4 and mean_probability[2] == 0.25 == frequency[2]
    # three classes: Brier sums over classes, ((0.3^2 + 0.2^2 + 0.1^2) + (0.2^2 + 0.5^2 + 0.7^2)) / 2 = 0.46;
    # ECE on the top class: 0.7 right (|1 - 0.7| = 0.3) and 0.5 wrong (|0 - 0.5| = 0.5): 0.4
    three = calibration_metrics(np.array([0, 2]), np.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3]]))
    assert three == pytest.approx({"brier": 0.46, "ece": 0.4})
    plot_reliability({"a": (labels, probs), "b": (labels, probs[:, ::-1])}, tmp_path / "reliability.png")
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
