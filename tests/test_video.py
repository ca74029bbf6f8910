"""The frame-sampling rule and the sequential decoder, on real (tiny) mp4 files."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from pipeline.data.video import VideoFailure, read_frames, read_sampled_frames, sample_frame_indices


def write_numbered_video(path: Path, n_frames: int, fps: int = 25) -> None:
    """Frame i is a flat image of grey level 10 * i, so a decoded frame tells which frame it is."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (64, 48))
    assert writer.isOpened()
    for index in range(n_frames):
        writer.write(np.full((48, 64, 3), 10 * index, np.uint8))
    writer.release()


def frame_number(frame: np.ndarray) -> int:
    return round(float(frame.mean()) / 10)


def test_sample_frame_indices_cover_the_window() -> None:
    indices = sample_frame_indices(138, 25.0, 8, start_s=2.0)
    assert len(indices) == 8 and list(indices) == sorted(set(indices.tolist()))
    assert indices[0] == 50 and indices[-1] == 137  # 2.0 s at 25 fps, and the last frame
    assert max(np.diff(indices)) - min(np.diff(indices)) <= 1  # evenly spaced
    assert list(sample_frame_indices(138, 25.0, 3, start_s=2.0, end_s=4.0)) == [50, 75, 100]


def test_a_short_window_gives_each_frame_once_and_an_empty_one_fails() -> None:
    assert list(sample_frame_indices(5, 25.0, 8, start_s=0.0)) == [0, 1, 2, 3, 4]
    with pytest.raises(VideoFailure, match="too short: 20 frames at 25 fps, window starts at 2.0 s"):
        sample_frame_indices(20, 25.0, 8, start_s=2.0)
    with pytest.raises(ValueError, match="frames_per_video must be >= 1"):
        sample_frame_indices(138, 25.0, 0, start_s=0.0)


def test_read_frames_decodes_exactly_the_asked_frames(tmp_path: Path) -> None:
    video = tmp_path / "numbered.mp4"
    write_numbered_video(video, 20)
    frames = read_frames(video, [0, 7, 19, 25])  # 25 is past the end: absent, not an error
    assert sorted(frames) == [0, 7, 19]
    assert {index: frame_number(frame) for index, frame in frames.items()} == {0: 0, 7: 7, 19: 19}


def test_read_sampled_frames_returns_the_window_in_order(tmp_path: Path) -> None:
    video = tmp_path / "numbered.mp4"
    write_numbered_video(video, 20)
    indices, frames, fps = read_sampled_frames(video, 4, start_s=0.2, end_s=0.6)
    assert fps == pytest.approx(25.0)
    assert list(indices) == list(sample_frame_indices(20, 25.0, 4, 0.2, 0.6)) == [5, 8, 12, 15]
    assert [frame_number(frame) for frame in frames] == [5, 8, 12, 15]
    with pytest.raises(VideoFailure, match="missing file"):
        read_sampled_frames(tmp_path / "missing.mp4", 4, start_s=0.0)
