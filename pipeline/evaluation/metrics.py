"""Frame- and video-level classification metrics, frame-to-video aggregation, and the plots a fold reports.

Everything here is a pure function of tables and arrays, so the CV driver and the comparison share one definition
of "video AUROC". Plots are drawn on a bare `Figure` (Agg canvas, no pyplot state) and written atomically.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import sklearn
from matplotlib.figure import Figure
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score, roc_auc_score, roc_curve

from pipeline.evaluation.aggregation import called_classes, check_aggregation
from pipeline.utils.atomic_io import save_png

VIDEO_KEYS = ["subject_name", "sample_name"]
PROB_PREFIX = "prob_"


def probability_columns(table: pd.DataFrame, class_names: Sequence[str] | None = None) -> list[str]:
    """The `prob_<class>` columns of a table, in class order when `class_names` is given, else in column order."""
    if class_names is None:
        columns = [column for column in table.columns if str(column).startswith(PROB_PREFIX)]
        if not columns:
            raise ValueError(f"no {PROB_PREFIX}<class> columns in table with columns {list(table.columns)}")
        return columns
    columns = [f"{PROB_PREFIX}{name}" for name in class_names]
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise ValueError(f"missing probability columns {missing}; table has {list(table.columns)}")
    return columns


def _require_columns(table: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise ValueError(f"{what} is missing columns {missing}; it has {list(table.columns)}")


def aggregate_videos(frames: pd.DataFrame, method: str, k: int, ordinal: bool = False) -> pd.DataFrame:
    """One row per video from per-frame class probabilities, by the rule of `pipeline.evaluation.aggregation`
    (the one `make predict` applies to a new video); `pred` is the argmax class index (`ordinal`: the level
    `aggregation.ordinal_decision` calls from the video's level probabilities)."""
    check_aggregation(method, k)
    _require_columns(frames, [*VIDEO_KEYS, "label"], "frame table")
    prob_columns = probability_columns(frames)
    if frames.empty:
        raise ValueError("frame table is empty: no frames to aggregate")
    bad_rows = frames.index[frames[prob_columns].isna().any(axis=1) | frames["label"].isna()]
    if len(bad_rows):
        raise ValueError(f"frame table has missing labels or probabilities in rows {list(bad_rows[:10])}")

    labels_per_video = frames.groupby(VIDEO_KEYS, sort=True)["label"].agg(["nunique", "first", "size"])
    conflicting = labels_per_video.index[labels_per_video["nunique"] > 1]
    if len(conflicting):
        names = ", ".join(f"{subject}/{sample}" for subject, sample in conflicting[:10])
        raise ValueError(f"{len(conflicting)} video(s) have frames with conflicting labels: {names}")

    grouped = frames.groupby(VIDEO_KEYS, sort=True)
    if method == "mean":
        probs = grouped[prob_columns].mean()
    elif method == "max":
        probs = grouped[prob_columns].max()
    else:
        probs = pd.DataFrame(
            {
                column: frames.sort_values(column, ascending=False, kind="stable")
                .groupby(VIDEO_KEYS, sort=True)
                .head(k)
                .groupby(VIDEO_KEYS, sort=True)[column]
                .mean()
                for column in prob_columns
            }
        )
    probs = probs.loc[labels_per_video.index]
    if method != "mean":
        totals = probs.sum(axis=1)
        if (totals <= 0).any():
            empty = ", ".join(f"{s}/{v}" for s, v in probs.index[totals <= 0][:10])
            raise ValueError(f"cannot renormalise aggregated probabilities that sum to 0 for videos: {empty}")
        probs = probs.div(totals, axis=0)

    videos = labels_per_video[["first"]].rename(columns={"first": "label"}).astype({"label": int})
    videos = videos.join(probs)
    videos["pred"] = called_classes(videos[prob_columns].to_numpy(), ordinal)
    videos["n_frames"] = labels_per_video["size"].astype(int)
    return videos.reset_index()


def classification_metrics(labels: np.ndarray, probs: np.ndarray, preds: np.ndarray | None = None) -> dict[str, float]:
    """Accuracy, balanced accuracy, AUROC and F1 of argmax predictions (or of the classes `preds` called: an ordinal
    model's levels).

    Binary (two columns): AUROC of class 1's probability and F1 of class 1. Multiclass: macro one-vs-rest AUROC
    over the classes that have both positives and negatives, and macro F1 over the classes seen in labels or
    predictions. AUROC is NaN when fewer than two classes are present, because a fold can legitimately lack one.
    """
    labels = np.asarray(labels)
    probs = np.asarray(probs, dtype=float)
    if probs.ndim != 2 or probs.shape[1] < 2:
        raise ValueError(f"probs must have shape (N, C) with C >= 2, got {probs.shape}")
    if labels.ndim != 1 or len(labels) != len(probs):
        raise ValueError(f"labels must have shape ({len(probs)},), got {labels.shape}")
    if len(labels) == 0:
        raise ValueError("no samples to score")
    if not np.issubdtype(labels.dtype, np.integer):
        if not np.all(np.equal(np.mod(labels, 1), 0)):
            raise ValueError("labels must be integer class indices")
        labels = labels.astype(int)
    n_classes = probs.shape[1]
    if labels.min() < 0 or labels.max() >= n_classes:
        raise ValueError(f"labels must lie in [0, {n_classes - 1}], got range [{labels.min()}, {labels.max()}]")
    if not np.isfinite(probs).all():
        raise ValueError("probs contain NaN or infinite values")

    preds = probs.argmax(axis=1) if preds is None else np.asarray(preds, dtype=int)
    # the inputs are checked above: scikit-learn's own checks of every call (a third of an evaluation's time) skipped
    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):
        return _scores(labels, probs, preds, n_classes)


def _scores(labels: np.ndarray, probs: np.ndarray, preds: np.ndarray, n_classes: int) -> dict[str, float]:
    present = np.unique(labels)
    if n_classes == 2:
        f1 = f1_score(labels, preds, pos_label=1, average="binary", zero_division=0)
        auroc = roc_auc_score(labels, probs[:, 1]) if len(present) == 2 else float("nan")
    else:
        f1 = f1_score(labels, preds, average="macro", zero_division=0)
        per_class = [roc_auc_score(labels == c, probs[:, c]) for c in present] if len(present) >= 2 else []
        auroc = float(np.mean(per_class)) if per_class else float("nan")
    with warnings.catch_warnings():
        # A fold whose labels lack a predicted class is normal; recall is averaged over the classes present.
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        balanced_accuracy = balanced_accuracy_score(labels, preds)
    return {
        "accuracy": float(accuracy_score(labels, preds)),
        "balanced_accuracy": float(balanced_accuracy),
        "auroc": float(auroc),
        "f1": float(f1),
    }


def confusion(labels: np.ndarray, preds: np.ndarray, n_classes: int) -> np.ndarray:
    """Counts with true class on rows and predicted class on columns, always `n_classes` x `n_classes`."""
    labels = np.asarray(labels, dtype=int)
    preds = np.asarray(preds, dtype=int)
    if labels.shape != preds.shape or labels.ndim != 1:
        raise ValueError(f"labels and preds must be 1-D of equal length, got {labels.shape} and {preds.shape}")
    for name, values in (("labels", labels), ("preds", preds)):
        if len(values) and (values.min() < 0 or values.max() >= n_classes):
            raise ValueError(f"{name} must lie in [0, {n_classes - 1}]")
    matrix = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(matrix, (labels, preds), 1)
    return matrix


def per_subject_accuracy(videos_or_frames: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per subject over the rows given (videos or frames); `pred` is taken as argmax when absent."""
    _require_columns(videos_or_frames, ["subject_name", "label"], "prediction table")
    if "pred" in videos_or_frames.columns:
        preds = videos_or_frames["pred"].to_numpy()
    else:
        preds = videos_or_frames[probability_columns(videos_or_frames)].to_numpy().argmax(axis=1)
    correct = pd.Series(preds == videos_or_frames["label"].to_numpy(), index=videos_or_frames.index)
    grouped = correct.groupby(videos_or_frames["subject_name"], sort=True)
    return pd.DataFrame({"n": grouped.size().astype(int), "accuracy": grouped.mean().astype(float)}).reset_index()


@dataclass
class Evaluation:
    """One split's predictions scored: metrics at frame and video level, the per-video table and its summaries."""

    frame_metrics: dict[str, float]
    video_metrics: dict[str, float]
    video_predictions: pd.DataFrame  # one row per video: labels, aggregated probabilities, prediction
    per_subject: pd.DataFrame  # video-level accuracy per subject
    confusion_frame: np.ndarray
    confusion_video: np.ndarray

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Both levels' metrics as one flat dict: `<prefix>frame_auroc`, `<prefix>video_accuracy`, ..."""
        return {f"{prefix}{level}_{name}": float(value)
                for level, values in (("frame", self.frame_metrics), ("video", self.video_metrics))
                for name, value in values.items()}


def evaluate_predictions(
    frames: pd.DataFrame, class_names: Sequence[str], aggregation: str, k: int, ordinal: bool = False
) -> Evaluation:
    """Frame and video metrics for one fold's per-frame predictions; per-subject accuracy is video-level. `ordinal`:
    the probabilities are an ordinal or regression output's level probabilities, and frames and videos are called
    by `aggregation.ordinal_decision` instead of argmax."""
    prob_columns = probability_columns(frames, class_names)
    _require_columns(frames, [*VIDEO_KEYS, "label"], "frame table")
    frames = frames[[*VIDEO_KEYS, "label", *prob_columns]]
    videos = aggregate_videos(frames, method=aggregation, k=k, ordinal=ordinal)
    frame_labels = frames["label"].to_numpy()
    frame_probs = frames[prob_columns].to_numpy(dtype=float)
    frame_preds = called_classes(frame_probs, ordinal)
    video_labels = videos["label"].to_numpy()
    n_classes = len(class_names)
    return Evaluation(
        frame_metrics=classification_metrics(frame_labels, frame_probs, frame_preds),
        video_metrics=classification_metrics(video_labels, videos[prob_columns].to_numpy(dtype=float),
                                             videos["pred"].to_numpy()),
        video_predictions=videos,
        per_subject=per_subject_accuracy(videos),
        confusion_frame=confusion(frame_labels, frame_preds, n_classes),
        confusion_video=confusion(video_labels, videos["pred"].to_numpy(), n_classes),
    )


def summarize_folds(fold_metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """`<metric>_mean` and `<metric>_std` (sample std, 0 for a single fold) over folds, ignoring NaNs."""
    names: list[str] = []
    for metrics in fold_metrics:
        names.extend(name for name in metrics if name not in names)
    summary: dict[str, float] = {}
    for name in names:
        values = np.array([float(metrics.get(name, np.nan)) for metrics in fold_metrics], dtype=float)
        values = values[~np.isnan(values)]
        if len(values) == 0:
            mean = std = float("nan")
        else:
            mean = float(values.mean())
            std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        summary[f"{name}_mean"] = mean
        summary[f"{name}_std"] = std
    return summary


def plot_confusion(matrix: np.ndarray, class_names: Sequence[str], path: str | os.PathLike, title: str = "") -> None:
    """Confusion matrix as a heat map with the count and row share written in each cell."""
    matrix = np.asarray(matrix)
    n_classes = len(class_names)
    if matrix.shape != (n_classes, n_classes):
        raise ValueError(f"matrix shape {matrix.shape} does not match {n_classes} class names")
    row_totals = matrix.sum(axis=1, keepdims=True)
    shares = np.divide(matrix, row_totals, out=np.zeros(matrix.shape, dtype=float), where=row_totals > 0)
    figure = Figure(figsize=(1.2 * n_classes + 2, 1.1 * n_classes + 1.5))
    axes = figure.add_subplot()
    image = axes.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axes, label="share of true class")
    for row in range(n_classes):
        for column in range(n_classes):
            colour = "white" if shares[row, column] > 0.5 else "black"
            axes.text(
                column,
                row,
                f"{matrix[row, column]}\n{shares[row, column]:.0%}",
                ha="center",
                va="center",
                color=colour,
                fontsize=9,
            )
    axes.set_xticks(range(n_classes), labels=list(class_names))
    axes.set_yticks(range(n_classes), labels=list(class_names))
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title(title)
    save_png(figure, path)


def plot_roc(labels: np.ndarray, probs_pos: np.ndarray, path: str | os.PathLike, title: str = "") -> None:
    """Binary ROC curve; with a single class present the figure says so instead of failing the fold."""
    labels = np.asarray(labels)
    probs_pos = np.asarray(probs_pos, dtype=float)
    figure = Figure(figsize=(5, 5))
    axes = figure.add_subplot()
    axes.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1)
    if len(np.unique(labels)) == 2:
        false_positive_rate, true_positive_rate, _ = roc_curve(labels, probs_pos)
        auroc = roc_auc_score(labels, probs_pos)
        axes.plot(false_positive_rate, true_positive_rate, label=f"AUROC = {auroc:.3f}")
        axes.legend(loc="lower right")
    else:
        axes.text(0.5, 0.5, "ROC undefined: only one class present", ha="center", va="center")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1)
    axes.set_xlabel("false positive rate")
    axes.set_ylabel("true positive rate")
    axes.set_title(title)
    save_png(figure, path)


def plot_training_curves(history: pd.DataFrame, path: str | os.PathLike) -> None:
    """Loss curves (every column with "loss" in its name) and validation metrics (other `val` columns) per epoch.

    Accepts a Lightning CSVLogger table, where each logged row fills only some columns: the last value logged in
    each epoch is plotted.
    """
    _require_columns(history, ["epoch"], "training history")
    numeric = history.drop(columns=[c for c in ("step",) if c in history.columns]).select_dtypes("number")
    per_epoch = numeric.groupby("epoch", sort=True).last()
    loss_columns = [c for c in per_epoch.columns if "loss" in str(c) and per_epoch[c].notna().any()]
    metric_columns = [
        c
        for c in per_epoch.columns
        if str(c).startswith("val") and c not in loss_columns and per_epoch[c].notna().any()
    ]
    if not loss_columns and not metric_columns:
        raise ValueError(f"training history has no loss or val metric columns: {list(history.columns)}")
    figure = Figure(figsize=(11, 4))
    loss_axes, metric_axes = figure.subplots(1, 2)
    for axes, columns, ylabel in ((loss_axes, loss_columns, "loss"), (metric_axes, metric_columns, "metric")):
        for column in columns:
            series = per_epoch[column].dropna()
            axes.plot(series.index, series.to_numpy(), marker="o", markersize=3, label=str(column))
        if columns:
            axes.legend()
        axes.set_xlabel("epoch")
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
    loss_axes.set_title("loss")
    metric_axes.set_title("validation metrics")
    save_png(figure, path)


CALIBRATION_BINS = 10


def calibration_terms(labels: np.ndarray, probs: np.ndarray,
                      n_bins: int = CALIBRATION_BINS) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per video, what every calibration number sums: its Brier term, its reliability bin, its confidence and its
    outcome (`calibration_metrics`, `reliability_bins`, and the subject bootstrap's resamples of them).

    Two classes: the pain (class 1) probability against whether the video is pain; Brier term (p - is pain)^2. More
    classes: the top class's probability (the confidence) against whether the top class is right; Brier term the
    sum over classes of (probability - one-hot)^2. Bin b holds [b / n, (b + 1) / n), the last one also 1.0.
    """
    labels = np.asarray(labels).astype(int)
    probs = np.asarray(probs, dtype=float)
    if probs.shape[1] == 2:
        confidence, outcome = probs[:, 1], (labels == 1).astype(float)
        brier = (confidence - outcome) ** 2
    else:
        confidence, outcome = probs.max(axis=1), (probs.argmax(axis=1) == labels).astype(float)
        brier = np.sum((probs - np.eye(probs.shape[1])[labels]) ** 2, axis=1)
    index = np.minimum(np.floor(confidence * n_bins).astype(int), n_bins - 1)
    return brier, index, confidence, outcome


def reliability_bins(labels: np.ndarray, probs: np.ndarray,
                     n_bins: int = CALIBRATION_BINS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width probability bin (`calibration_terms`): (count, mean predicted probability, observed
    frequency); empty bins have NaN means."""
    _, index, confidence, outcome = calibration_terms(labels, probs, n_bins)
    counts = np.bincount(index, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_probability = np.bincount(index, weights=confidence, minlength=n_bins) / counts
        frequency = np.bincount(index, weights=outcome, minlength=n_bins) / counts
    return counts, mean_probability, frequency


def expected_calibration_error(counts: np.ndarray, confidence_sums: np.ndarray,
                               outcome_sums: np.ndarray) -> np.ndarray:
    """ECE from per-bin sums over the videos (last axis: the bins; leading axes, e.g. bootstrap resamples, kept):
    the share-weighted |observed frequency - mean probability|, i.e. sum over bins of |outcomes - confidences| over
    the videos."""
    return np.abs(outcome_sums - confidence_sums).sum(axis=-1) / counts.sum(axis=-1)


def calibration_metrics(labels: np.ndarray, probs: np.ndarray, n_bins: int = CALIBRATION_BINS) -> dict[str, float]:
    """Brier score and expected calibration error (ECE) of video probabilities (`calibration_terms`).

    Brier: the mean over videos of the Brier term. ECE: over `n_bins` equal-width bins, the mean of
    |observed frequency - mean probability| weighted by each bin's share of the videos. Both 0 when perfect.
    """
    labels = np.asarray(labels).astype(int)
    if len(labels) == 0:
        return {"brier": float("nan"), "ece": float("nan")}
    brier, index, confidence, outcome = calibration_terms(labels, probs, n_bins)
    sums = [np.bincount(index, weights=weights, minlength=n_bins) for weights in (None, confidence, outcome)]
    return {"brier": float(np.mean(brier)), "ece": float(expected_calibration_error(*sums))}


def plot_reliability(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str | os.PathLike,
                     title: str = "", n_bins: int = CALIBRATION_BINS) -> None:
    """Reliability diagram: per named (labels, probs), observed frequency against mean probability per bin (marker
    size ~ videos in the bin), the diagonal of perfect calibration, Brier and ECE in the legend."""
    figure = Figure(figsize=(5.5, 5))
    axes = figure.add_subplot()
    axes.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfectly calibrated")
    binary = True
    for name, (labels, probs) in curves.items():
        probs = np.asarray(probs, dtype=float)
        binary = binary and probs.shape[1] == 2
        counts, mean_probability, frequency = reliability_bins(labels, probs, n_bins)
        filled = counts > 0
        scores = calibration_metrics(labels, probs, n_bins)
        axes.plot(mean_probability[filled], frequency[filled], marker="o", markersize=3,
                  label=f"{name}: Brier {scores['brier']:.3f}, ECE {scores['ece']:.3f}")
        axes.scatter(mean_probability[filled], frequency[filled], s=200 * counts[filled] / counts.sum(), alpha=0.3)
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1)
    axes.set_xlabel("mean predicted pain probability" if binary else "mean confidence (top class)")
    axes.set_ylabel("share of videos that are pain" if binary else "share of top-class calls that are right")
    axes.set_title(title or f"reliability of video probabilities ({n_bins} bins)", fontsize=9)
    axes.legend(fontsize=7, loc="upper left")
    axes.grid(alpha=0.3)
    save_png(figure, path)


def decided_confusions(videos: pd.DataFrame, n_classes: int) -> dict[int | None, np.ndarray]:
    """Video confusion matrices from the calls as they were made (the `decision` column: the fold's threshold;
    argmax `pred` where there is none), one per training seed (`seed` column) and never over seeds averaged
    together; key None for a CV without seeds."""
    column = "decision" if "decision" in videos.columns else "pred"
    if "seed" not in videos.columns:
        return {None: confusion(videos["label"].to_numpy(), videos[column].to_numpy(), n_classes)}
    return {int(seed): confusion(part["label"].to_numpy(), part[column].to_numpy(), n_classes)
            for seed, part in videos.groupby("seed", sort=True)}


def decided_per_subject(videos: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per subject (and per seed, with a `seed` column) of the calls as they were made (`decision`)."""
    table = videos.assign(pred=videos["decision"]) if "decision" in videos.columns else videos
    if "seed" not in table.columns:
        return per_subject_accuracy(table)
    return pd.concat([per_subject_accuracy(part).assign(seed=seed) for seed, part in table.groupby("seed")],
                     ignore_index=True)
