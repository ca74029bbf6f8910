"""The baseline protocol's fair comparator (pipeline/analysis/score_offset.py, issue 43 item 5b): a plain model's video
scores minus the mean score of the person's k reference BL1 videos, the very videos a baseline CV takes, which leave
the test set; a threshold chosen on the validation people's offsets."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline.analysis.score_offset import offset_fold, offset_videos, reference_videos
from pipeline.data.personalise import label_free_rows, select_baseline

CLASSES = ("BL1", "PA2")


def video_table(people: dict[str, list[tuple[int, float]]]) -> pd.DataFrame:
    """One row per video: (label, plain pain score) per person, in the CV's layout."""
    rows = [{"subject_name": person, "sample_name": f"{person}-{index:02d}", "label": label,
             "prob_BL1": 1.0 - score, "prob_PA2": score}
            for person, videos in people.items() for index, (label, score) in enumerate(videos)]
    return pd.DataFrame(rows)


def test_a_tiny_case_worked_by_hand() -> None:
    # p0 rests at 0.6 (both BL1 videos), its pain video scores 0.7; p1 rests at 0.1, its pain video scores 0.3
    videos = video_table({"p0": [(0, 0.6), (0, 0.6), (1, 0.7)], "p1": [(0, 0.1), (0, 0.1), (1, 0.3)]})
    reference = np.array([True, False, False, True, False, False])  # the first BL1 video of each
    offset = offset_videos(videos, reference, CLASSES)
    assert offset["sample_name"].tolist() == ["p0-01", "p0-02", "p1-01", "p1-02"]  # the references left out
    np.testing.assert_allclose(offset["prob_PA2"], (1 + np.array([0.0, 0.1, 0.0, 0.2])) / 2)
    np.testing.assert_allclose(offset["prob_BL1"], 1 - offset["prob_PA2"])
    np.testing.assert_allclose(offset["plain_score"], [0.6, 0.7, 0.1, 0.3])
    # one shared threshold on the plain scores cannot serve both people; on the offsets 0.05 calls every video right
    plain_right = ((videos["prob_PA2"] >= 0.5) == videos["label"].astype(bool)).mean()
    offset_right = (((offset["prob_PA2"] - 0.5) * 2 >= 0.05) == offset["label"].astype(bool)).mean()
    assert plain_right < 1.0 and offset_right == 1.0
    with pytest.raises(ValueError, match="no reference video for p1"):
        offset_videos(videos, np.array([True, False, False, False, False, False]), CLASSES)
    with pytest.raises(ValueError, match="a binary task only"):
        offset_videos(videos, reference, ("BL1", "PA1", "PA2"))


def test_the_references_are_the_videos_a_baseline_cv_takes_from_the_same_people() -> None:
    """Drawn on one row per video, the references are those `select_baseline` takes from the crop rows."""
    rng = np.random.default_rng(0)
    videos = video_table({f"p{i}": [(label, float(rng.uniform())) for label in [0] * 5 + [1] * 5] for i in range(6)})
    crops = videos.loc[videos.index.repeat(3)].reset_index(drop=True)
    crops["class_name"] = np.asarray(CLASSES)[crops["label"]]
    rows, is_bl1 = label_free_rows(crops.drop(columns=["label"]))
    taken = select_baseline(rows, is_bl1, k=2, seed=0).reference
    mask = reference_videos(videos, CLASSES, k=2, seed=0)
    assert set(map(tuple, videos.loc[mask, ["subject_name", "sample_name"]].to_numpy())) == set(
        map(tuple, taken[["subject_name", "sample_name"]].drop_duplicates().to_numpy()))
    assert (videos.loc[mask, "label"] == 0).all() and videos.loc[mask].groupby("subject_name").size().eq(2).all()


def test_a_fold_chooses_its_threshold_on_the_validation_offsets_only() -> None:
    rng = np.random.default_rng(1)

    def people(names: list[str]) -> pd.DataFrame:
        # each person's resting level differs widely; pain adds 0.2 to it
        return video_table({name: [(label, float(np.clip(level + 0.2 * label + rng.normal(0, 0.02), 0, 1)))
                                   for label in [0] * 4 + [1] * 4]
                            for name, level in zip(names, rng.uniform(0.1, 0.7, len(names)), strict=True)})

    val, test = people(["v0", "v1", "v2"]), people(["t0", "t1", "t2", "t3"])
    decided = offset_fold(val, test, CLASSES, k=2, seed=0, rule="youden")
    assert len(decided.videos) == len(test) - 2 * 4  # each test person's two references left out
    assert 0.5 < decided.threshold < 0.6  # between the offsets of rest (about 0) and pain (about 0.2), carried
    assert decided.metrics["video_accuracy_at_threshold"] == 1.0
    # the test videos do not move it: other test scores, the same threshold
    again = offset_fold(val, people(["t4", "t5"]), CLASSES, k=2, seed=0, rule="youden")
    assert again.threshold == decided.threshold
