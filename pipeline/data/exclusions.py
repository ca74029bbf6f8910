"""What face detection left out, counted per class and per subject, and which participants a task cannot use.

A video is lost when no face was found in any of its sampled frames (or it failed otherwise: `failures.csv`). If pain
videos (grimaces, head movements) are lost more often than baseline ones, every score is measured on an easier set
than the one recorded; the tables make that visible and `lost_share_warning` names a gap above two points.

A participant is usable for a task only when the videos it kept hold the task's classes: at least one of them, and
both for a binary task. Others are left out of that task's folds by name instead of failing a fold.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import pandas as pd

from pipeline.data.tasks import NO_PAIN, Task

log = logging.getLogger(__name__)

BASELINE = NO_PAIN
MAX_GAP = 0.02  # lost-pain share against lost-baseline share: more than two points apart is reported
COLUMNS = ["videos", "videos_lost", "share_lost", "sampled_frames", "detected_frames", "detection_rate"]


def exclusion_tables(frames: pd.DataFrame, failures: pd.DataFrame,
                     frames_per_video: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per class and per subject: videos, videos lost, sampled frames and frames with a detected face.

    A kept video's sampled frames are its rows in the frame table; a lost one counts `frames_per_video` sampled
    frames (what preprocessing asked for) and none detected.
    """
    kept = frames.groupby(["subject_name", "class_name", "sample_name"]).agg(
        sampled_frames=("frame_index", "size"),
        detected_frames=("detection", lambda d: int((d == "detected").sum()))).reset_index()
    kept["videos_lost"] = 0
    lost = failures[["subject_name", "class_name", "sample_name"]].drop_duplicates("sample_name").assign(
        sampled_frames=frames_per_video, detected_frames=0, videos_lost=1)
    videos = pd.concat([kept, lost], ignore_index=True)

    def by(column: str) -> pd.DataFrame:
        table = videos.groupby(column, sort=True).agg(
            videos=("sample_name", "size"), videos_lost=("videos_lost", "sum"),
            sampled_frames=("sampled_frames", "sum"), detected_frames=("detected_frames", "sum"))
        table["share_lost"] = table["videos_lost"] / table["videos"]
        table["detection_rate"] = table["detected_frames"] / table["sampled_frames"]
        return table[COLUMNS].reset_index()

    return by("class_name"), by("subject_name")


def lost_share_warning(per_class: pd.DataFrame, max_gap: float = MAX_GAP) -> str | None:
    """A sentence when the share of lost pain videos and of lost baseline videos differ by more than `max_gap`."""
    baseline = per_class[per_class["class_name"] == BASELINE]
    pain = per_class[per_class["class_name"] != BASELINE]
    if baseline.empty or pain.empty:
        return None
    baseline_share = float(baseline["videos_lost"].sum() / baseline["videos"].sum())
    pain_share = float(pain["videos_lost"].sum() / pain["videos"].sum())
    if abs(pain_share - baseline_share) <= max_gap:
        return None
    return (f"face detection lost {pain_share:.1%} of the pain videos but {baseline_share:.1%} of the baseline "
            f"videos (more than {max_gap:.0%} apart): the scores are measured on a set where one class lost more "
            f"of its videos than the other; see the per-class exclusion table")


def format_tables(per_class: pd.DataFrame, per_subject: pd.DataFrame) -> str:
    """The per-class table and the subjects that lost any video, as `make data` prints them."""
    def shares(table: pd.DataFrame) -> str:
        return table.to_string(index=False, formatters={"share_lost": "{:.1%}".format,
                                                        "detection_rate": "{:.1%}".format})

    losing = per_subject[per_subject["videos_lost"] > 0]
    lines = ["videos and frames per class (lost: no face in any sampled frame, or failed):", shares(per_class)]
    lines.append(f"subjects that lost videos: {len(losing)} of {len(per_subject)}"
                 + (":\n" + shares(losing) if len(losing) else ""))
    return "\n".join(lines)


def unusable_for_task(frames: pd.DataFrame, task: Task) -> dict[str, str]:
    """Participants whose kept videos cannot serve `task`, with the reason: no video of its classes, or (binary)
    videos of one of its classes only."""
    classes = frames[frames["class_name"].isin(task.classes)].groupby("subject_name")["class_name"].unique()
    reasons = {}
    for subject in sorted(set(frames["subject_name"])):
        present = sorted(classes.get(subject, []))
        if not present:
            kept = sorted(set(frames.loc[frames["subject_name"] == subject, "class_name"]))
            reasons[subject] = f"no video of {', '.join(task.classes)} left (kept: {', '.join(kept)})"
        elif task.is_binary and len(present) < 2:
            reasons[subject] = f"only {present[0]} videos left of {' and '.join(task.classes)}"
    return reasons


def folds_without_test_subjects(folds: pd.DataFrame, unusable: Mapping[str, str],
                                fold_ids: Sequence[int]) -> list[int]:
    """Folds whose every test subject is unusable for the task: nothing is left to test there."""
    test = folds[folds["role"] == "test"]
    return [fold for fold in fold_ids
            if set(test.loc[test["fold"] == fold, "subject_name"]) <= set(unusable)]


def usable_task_frames(task_frames: pd.DataFrame, task: Task) -> pd.DataFrame:
    """A binary task's frames without the participants that kept videos of one of its classes only (named in a
    warning): such a participant can be neither ranked nor balanced within itself, so it is left out of the task."""
    if not task.is_binary or task_frames.empty:
        return task_frames
    classes = task_frames.groupby("subject_name")["class_name"].nunique()
    partial = sorted(classes.index[classes < 2])
    if not partial:
        return task_frames
    log.warning("left out of %s: %s (videos of one of its classes only)", task.name, ", ".join(partial))
    return task_frames[~task_frames["subject_name"].isin(partial)]
