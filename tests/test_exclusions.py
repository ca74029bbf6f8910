"""Exclusions per class and subject, the lost-share warning, and participants a task cannot use."""

from __future__ import annotations

import pandas as pd

from pipeline.data.exclusions import (
    exclusion_tables,
    folds_without_test_subjects,
    lost_share_warning,
    unusable_for_task,
)
from pipeline.data.tasks import get_task
from pipeline.runs.orchestration.cross_validation import data_error_message


def frame_rows(subject: str, class_name: str, sample: str, detected: int, held: int) -> list[dict]:
    return [{"subject_name": subject, "class_name": class_name, "sample_name": sample, "frame_index": i,
             "detection": "detected" if i < detected else "held"} for i in range(detected + held)]


def test_tables_count_kept_and_lost_videos_per_class_and_subject() -> None:
    frames = pd.DataFrame(frame_rows("s1", "BL1", "a", 3, 1) + frame_rows("s1", "PA4", "b", 4, 0)
                          + frame_rows("s2", "BL1", "c", 2, 2) + frame_rows("s3", "PA2", "e", 4, 0)
                          + frame_rows("s3", "PA3", "f", 4, 0))
    failures = pd.DataFrame({"subject_name": ["s2"], "class_name": ["PA4"], "sample_name": ["d"],
                             "reason": ["no face detected in any of the 4 sampled frames"]})
    per_class, per_subject = exclusion_tables(frames, failures, frames_per_video=4)
    pa4 = per_class.set_index("class_name").loc["PA4"]
    assert (pa4.videos, pa4.videos_lost, pa4.sampled_frames, pa4.detected_frames) == (2, 1, 8, 4)
    bl1 = per_class.set_index("class_name").loc["BL1"]
    assert (bl1.videos, bl1.videos_lost, bl1.detected_frames, bl1.detection_rate) == (2, 0, 5, 5 / 8)
    s2 = per_subject.set_index("subject_name").loc["s2"]
    assert (s2.videos, s2.videos_lost, s2.share_lost) == (2, 1, 0.5)
    # pain lost 1 of 4 videos (25 %), baseline 0 of 2: more than two points apart
    assert "25.0% of the pain videos but 0.0% of the baseline" in lost_share_warning(per_class)
    assert lost_share_warning(per_class.assign(videos_lost=0)) is None


def test_a_participant_without_the_task_classes_is_named_and_its_fold_left_out() -> None:
    frames = pd.DataFrame(frame_rows("s1", "BL1", "a", 1, 0) + frame_rows("s1", "PA4", "b", 1, 0)
                          + frame_rows("s2", "BL1", "c", 1, 0) + frame_rows("s3", "PA2", "e", 1, 0)
                          + frame_rows("s3", "PA3", "f", 1, 0))
    unusable = unusable_for_task(frames, get_task("bl1_vs_pa4"))
    assert unusable == {"s2": "only BL1 videos left of BL1 and PA4",
                        "s3": "no video of BL1, PA4 left (kept: PA2, PA3)"}
    assert set(unusable_for_task(frames, get_task("five_class"))) == set()  # every one kept some of the five
    loso = pd.DataFrame({"fold": [0, 0, 1, 1, 2, 2], "subject_name": ["s1", "s2", "s2", "s3", "s3", "s1"],
                         "role": ["test", "train", "test", "train", "test", "train"]})
    assert folds_without_test_subjects(loso, unusable, [0, 1, 2]) == [1, 2]


def test_a_data_error_is_not_called_retryable() -> None:
    message = data_error_message({2: "ValueError: folds.csv, fold 2: role 'test' has no frames of task bl1_vs_pa4"})
    assert "fails the same way" in message and "fold 2" in message
    assert data_error_message({1: "RuntimeError: CUDA out of memory"}) is None
