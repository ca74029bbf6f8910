"""Video -> face crops on real mp4 files: frame table, resumability, refusal to mix settings, failures reported."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from pipeline.data.biovid import load_samples
from pipeline.data.crop_geometry import CANONICAL_LANDMARKS
from pipeline.data.face_crops import (
    BOX_COLUMNS,
    FRAME_COLUMNS,
    LANDMARK_COLUMNS,
    TRANSFORM_COLUMNS,
    preprocess,
    video_to_crop,
)
from pipeline.data.faces import HaarFaceDetector, detection_rate
from pipeline.data.prepare import preprocess_config
from pipeline.data.video import sample_frame_indices
from pipeline.utils.config import load_config
from tests.photo_clips import PhotoClip, astronaut, clip_frames

PROJECT_CONFIG = preprocess_config(load_config().preprocess)  # the settings `make data` uses; tests change a few
CONFIG = replace(PROJECT_CONFIG, frames_per_video=3, crop_size=48)


def write_video(path: Path, frames: list[np.ndarray], fps: int = 25) -> None:
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    for frame in frames:
        writer.write(frame)
    writer.release()


@pytest.fixture()
def few_samples(tiny_base: Path) -> pd.DataFrame:
    samples, _ = load_samples(tiny_base / "raw")
    return samples.groupby("class_name").head(1).reset_index(drop=True)


@pytest.mark.parametrize("detector", ["mtcnn", "haar"])
def test_crops_and_frame_table(few_samples: pd.DataFrame, tmp_path: Path, detector: str) -> None:
    """The default (MTCNN, aligned) and Haar (square crops with a margin, no landmarks) on the default twin."""
    config = replace(CONFIG, detector=detector, align=detector == "mtcnn")
    result = preprocess(few_samples, tmp_path, config, workers=1, progress=False)
    frames = pd.read_csv(tmp_path / "frames.csv")
    assert list(frames.columns) == list(FRAME_COLUMNS)
    assert set(frames.detection) <= {"detected", "reused", "backfilled"}
    assert (frames.time_s >= 2.0).all()
    crop = cv2.imread(str(tmp_path / frames.crop_path[0]))
    assert crop.shape == (48, 48, 3)
    assert not list(tmp_path.rglob(".*"))  # no temporary files left behind
    # where each crop came from: the box, the landmarks (MTCNN only) and the video -> crop transform
    assert frames[list(BOX_COLUMNS + TRANSFORM_COLUMNS)].notna().all().all()
    landmarks = frames[list(LANDMARK_COLUMNS)]
    row = frames.iloc[0]
    if detector == "mtcnn":
        assert len(frames) == len(few_samples) * 3 and result.failures.empty
        assert (frames.detection == "detected").mean() >= 0.95
        assert landmarks.notna().all().all()
        # aligned: the eyes land where the canonical face has them, whatever the head's roll and size
        eyes = video_to_crop(row, [[row.eye_left_x, row.eye_left_y], [row.eye_right_x, row.eye_right_y]])
        np.testing.assert_allclose(eyes.mean(0), (CANONICAL_LANDMARKS[:2].mean(0) + 0.2) / 1.4 * 48, atol=2.0)
    else:  # the hard twin defeats Haar on some frames and maybe whole videos: every video is still accounted for
        assert frames.sample_name.nunique() + len(result.failures) == len(few_samples)
        assert landmarks.isna().all().all()
        corners = video_to_crop(row, [[row.box_x, row.box_y], [row.box_x + row.box_w, row.box_y + row.box_h]])
        assert (corners[0] > 0).all() and (corners[1] < 48).all()  # the face box lies inside its crop (the margin)


def test_rerun_resumes_and_refuses_other_settings(few_samples: pd.DataFrame, tmp_path: Path) -> None:
    preprocess(few_samples, tmp_path, CONFIG, workers=2, progress=False)
    crop = next((tmp_path / "crops").rglob("*.jpg"))
    before = crop.stat().st_mtime_ns
    # a video whose rows vanished (as after a kill before its marker was written) is redone, the others are kept
    first = few_samples.iloc[0]
    (tmp_path / "videos" / first.subject_name / f"{first.sample_name}.csv").unlink()
    result = preprocess(few_samples, tmp_path, CONFIG, workers=1, progress=False)
    assert (result.n_resumed, result.n_processed) == (len(few_samples) - 1, 1)
    assert crop.stat().st_mtime_ns == before or crop.parent.name == first.sample_name
    assert len(result.frames) == len(few_samples) * 3
    with pytest.raises(ValueError, match="other settings .*crop_size"):
        preprocess(few_samples, tmp_path, replace(CONFIG, crop_size=32), progress=False)


def test_a_rerun_with_every_video_done_reads_the_frame_table_once(few_samples: pd.DataFrame, tmp_path: Path) -> None:
    """Every video cropped and the frame table newer than their tables: a rerun (each CV's start) takes the frame
    table as it is, not rewritten; a video's table that changed since, or another set of videos, gathers and writes
    it again."""
    first = preprocess(few_samples, tmp_path, CONFIG, workers=1, progress=False)
    frames_csv = tmp_path / "frames.csv"
    written = frames_csv.stat().st_mtime_ns
    again = preprocess(few_samples, tmp_path, CONFIG, workers=1, progress=False)
    assert frames_csv.stat().st_mtime_ns == written  # not rewritten: read as it is
    assert (again.n_resumed, again.n_processed) == (len(few_samples), 0) and again.failures.empty
    pd.testing.assert_frame_equal(again.frames, pd.read_csv(frames_csv))
    assert len(again.frames) == len(first.frames) == len(few_samples) * 3
    # one video's table rewritten after the frame table (its last row gone): the table is gathered again
    sample = few_samples.iloc[0]
    table = tmp_path / "videos" / sample.subject_name / f"{sample.sample_name}.csv"
    pd.read_csv(table).iloc[:-1].to_csv(table, index=False)
    os.utime(table, ns=(written + 10**9, written + 10**9))
    changed = preprocess(few_samples, tmp_path, CONFIG, workers=1, progress=False)
    assert len(changed.frames) == len(pd.read_csv(frames_csv)) == len(few_samples) * 3 - 1
    # fewer videos than the frame table holds: gathered for those videos only
    fewer = preprocess(few_samples.iloc[1:], tmp_path, CONFIG, workers=1, progress=False)
    assert set(pd.read_csv(frames_csv).sample_name) == set(few_samples.sample_name[1:]) == set(fewer.frames.sample_name)


def test_bad_videos_are_reported_not_dropped(few_samples: pd.DataFrame, tmp_path: Path) -> None:
    videos = tmp_path / "videos_in"
    videos.mkdir()
    rng = np.random.default_rng(0)
    cases = {
        "corrupt": lambda p: p.write_bytes(os.urandom(4096)),
        "empty": lambda p: p.write_bytes(b""),
        "noface": lambda p: write_video(p, [np.full((120, 160, 3), 90, np.uint8) for _ in range(138)]),
        "short": lambda p: write_video(p, [rng.integers(0, 255, (120, 160, 3), dtype=np.uint8) for _ in range(10)]),
    }
    bad = []
    for name, make in cases.items():
        path = videos / f"{name}.mp4"
        make(path)
        bad.append({**few_samples.iloc[0].to_dict(), "sample_name": f"bad-{name}", "video_path": str(path)})
    samples = pd.concat([few_samples.iloc[[1]], pd.DataFrame(bad)], ignore_index=True)
    result = preprocess(samples, tmp_path / "out", CONFIG, workers=1, progress=False)

    failures = pd.read_csv(tmp_path / "out" / "failures.csv").set_index("sample_name")
    assert sorted(failures.index) == sorted(f"bad-{name}" for name in cases)
    assert "unreadable" in failures.reason["bad-corrupt"]
    assert "empty file" in failures.reason["bad-empty"]
    assert "no face detected" in failures.reason["bad-noface"]
    assert "too short" in failures.reason["bad-short"]
    assert failures.video_path["bad-empty"].endswith("empty.mp4")
    assert result.frames.sample_name.unique().tolist() == [few_samples.sample_name[1]]
    assert "4 failed video(s)" in result.summary()


def test_real_photograph_video_is_cropped(tmp_path: Path) -> None:
    """The detector path on a real face: a still clip of scikit-image's astronaut photograph."""
    from skimage import data

    photo = cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)
    write_video(tmp_path / "astronaut.mp4", [photo] * 75)
    sample = {"subject_name": "010101_w_30", "sample_name": "010101_w_30-BL1-000", "class_id": 0, "class_name": "BL1",
              "video_path": str(tmp_path / "astronaut.mp4")}
    result = preprocess(pd.DataFrame([sample]), tmp_path / "out", CONFIG, workers=1, progress=False)
    assert result.failures.empty and (result.frames.detection == "detected").all()
    shutil.rmtree(tmp_path / "out")


def _astronaut_sample(path: Path) -> dict:
    return {"subject_name": "010101_w_30", "sample_name": "010101_w_30-BL1-000", "class_id": 0, "class_name": "BL1",
            "video_path": str(path)}


def test_detection_rate_measures_the_frames_preprocessing_crops(tmp_path: Path) -> None:
    """One sampling rule: the face is only in the frames the window [0.2 s, 0.6 s] picks, and both paths see it."""
    from skimage import data

    photo = cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)
    sampled = sample_frame_indices(20, 25.0, 4, start_s=0.2, end_s=0.6).tolist()
    assert sampled == [5, 8, 12, 15]
    blank = np.full_like(photo, 90)
    write_video(tmp_path / "clip.mp4", [photo if index in sampled else blank for index in range(20)])
    config = replace(CONFIG, frames_per_video=4, start_s=0.2, end_s=0.6)

    result = preprocess(pd.DataFrame([_astronaut_sample(tmp_path / "clip.mp4")]), tmp_path / "out", config,
                        workers=1, progress=False)
    assert result.frames.frame_index.tolist() == sampled
    assert (result.frames.detection == "detected").all()
    rate = detection_rate([tmp_path / "clip.mp4"], HaarFaceDetector(), frames_per_video=4, start_s=0.2, end_s=0.6)
    assert (rate["n_frames"], rate["n_detected"]) == (4, 4)

    # where the window starts after the clip ends, both refuse the video for the same reason
    late = replace(config, start_s=1.0, end_s=None)
    failed = preprocess(pd.DataFrame([_astronaut_sample(tmp_path / "clip.mp4")]), tmp_path / "late", late,
                        workers=1, progress=False).failures
    rate = detection_rate([tmp_path / "clip.mp4"], HaarFaceDetector(), frames_per_video=4, start_s=1.0)
    assert rate["n_frames"] == 0
    assert failed.reason.tolist() == list(rate["failed"].values()) == [
        "too short: 20 frames at 25 fps, window starts at 1.0 s"]


def test_preprocess_picks_its_worker_count_without_an_affinity_mask(tmp_path: Path, monkeypatch) -> None:
    """macOS has no os.sched_getaffinity: `make data` (workers=None) must still run there."""
    from skimage import data

    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    photo = cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)
    write_video(tmp_path / "astronaut.mp4", [photo] * 75)
    result = preprocess(pd.DataFrame([_astronaut_sample(tmp_path / "astronaut.mp4")]), tmp_path / "out", CONFIG,
                        workers=None, progress=False)
    assert result.failures.empty and len(result.frames) == CONFIG.frames_per_video


def test_aligned_crops_record_landmarks_and_transform(tmp_path: Path) -> None:
    """MTCNN + alignment on a real face rolled by 15 degrees: the crop is upright, and the recorded landmarks mapped
    through the recorded transform sit on the canonical face of the crop."""
    clip = PhotoClip(0.3, roll_deg=15.0, width=320, height=240, n_frames=75)
    write_video(tmp_path / "rolled.mp4", clip_frames(astronaut(), clip))
    config = replace(CONFIG, detector="mtcnn", align=True, crop_size=64)
    result = preprocess(pd.DataFrame([_astronaut_sample(tmp_path / "rolled.mp4")]), tmp_path / "out", config,
                        workers=1, progress=False, device="cpu")
    frames = result.frames
    assert result.failures.empty and (frames.detection == "detected").all()
    assert frames[list(FRAME_COLUMNS)].notna().all().all()
    for _, row in frames.iterrows():
        landmarks = row[list(LANDMARK_COLUMNS)].to_numpy(float).reshape(5, 2)
        eyes = video_to_crop(row, landmarks[:2])
        assert abs(eyes[1, 1] - eyes[0, 1]) < 2.0  # level in the crop, though rolled by 15 degrees in the video
        np.testing.assert_allclose(eyes.mean(0), (CANONICAL_LANDMARKS[:2].mean(0) + 0.2) / 1.4 * 64, atol=2.0)
        assert cv2.imread(str(tmp_path / "out" / row.crop_path)).shape == (64, 64, 3)


def test_alignment_needs_landmarks_and_settings_are_checked(few_samples: pd.DataFrame, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="align needs landmarks.*haar"):
        replace(CONFIG, detector="haar", align=True)
    # a folder whose preprocess.json predates the align setting is resumed (it was made unaligned) ...
    unaligned = replace(CONFIG, align=False)
    preprocess(few_samples.iloc[:1], tmp_path, unaligned, workers=1, progress=False)
    stored = json.loads((tmp_path / "preprocess.json").read_text())
    del stored["align"]
    (tmp_path / "preprocess.json").write_text(json.dumps(stored))
    resumed = preprocess(few_samples.iloc[:1], tmp_path, unaligned, workers=1, progress=False, source="twin-a")
    assert resumed.n_resumed == 1
    # ... and, once the source of its videos is recorded, crops of other videos are refused
    with pytest.raises(ValueError, match="videos were generated with other settings"):
        preprocess(few_samples.iloc[:1], tmp_path, unaligned, workers=1, progress=False, source="twin-b")
    with pytest.raises(ValueError, match="other settings .*align"):
        preprocess(few_samples.iloc[:1], tmp_path, replace(CONFIG, detector="mtcnn", align=True), progress=False,
                   source="twin-a")
