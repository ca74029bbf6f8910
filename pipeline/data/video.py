"""Frames from a clip: which frames to sample, and decoding only those.

One sampling rule serves preprocessing (`pipeline.data.face_crops`) and the detection-rate diagnostic
(`pipeline.data.faces.detection_rate`), so a detection rate describes exactly the frames that become crops.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import cv2
import numpy as np

DEFAULT_FPS = 25.0  # BioVid's frame rate; used when a container does not report one


class VideoFailure(Exception):
    """A video that yields no usable frames; the message is the reason (preprocessing records it in failures.csv)."""


def sample_frame_indices(
    n_frames: int, fps: float, frames_per_video: int, start_s: float, end_s: float | None = None
) -> np.ndarray:
    """Sorted indices of `frames_per_video` frames evenly spread over [start_s, end_s] of the clip.

    `end_s` None means to the last frame. A window holding fewer frames than asked yields each of its frames once.
    A clip that ends before the window starts is a VideoFailure.
    """
    if frames_per_video < 1:
        raise ValueError(f"frames_per_video must be >= 1, got {frames_per_video}")
    first = int(round(start_s * fps))
    last = n_frames - 1 if end_s is None else min(n_frames - 1, int(round(end_s * fps)))
    if last < first:
        raise VideoFailure(f"too short: {n_frames} frames at {fps:g} fps, window starts at {start_s} s")
    return np.unique(np.linspace(first, last, frames_per_video).round().astype(int))


def read_frames(video_path: str | Path, indices: Iterable[int]) -> dict[int, np.ndarray]:
    """Decode the given frames (index -> BGR frame) by reading the video sequentially; seeking is inexact in mp4.

    Frames past the end of the stream or that fail to decode are absent from the result.
    """
    wanted = set(int(index) for index in indices)
    capture = cv2.VideoCapture(str(video_path))
    if not capture.isOpened():
        raise ValueError(f"cannot open video {video_path}")
    frames: dict[int, np.ndarray] = {}
    try:
        index = 0
        last = max(wanted, default=-1)
        while index <= last and capture.grab():
            if index in wanted:
                ok, frame = capture.retrieve()
                if ok:
                    frames[index] = frame
            index += 1
    finally:
        capture.release()
    return frames


def count_frames(video_path: str | Path) -> int:
    """The number of frames the stream really holds (a container's own count can be wrong)."""
    capture = cv2.VideoCapture(str(video_path))
    count = 0
    try:
        while capture.grab():
            count += 1
    finally:
        capture.release()
    return count


def read_sampled_frames(
    video_path: str | Path, frames_per_video: int, start_s: float, end_s: float | None = None
) -> tuple[np.ndarray, list[np.ndarray], float]:
    """The sampled frames of a clip (`sample_frame_indices`): their indices, the frames in that order, and the fps.

    Only the sampled frames are kept in memory: a full-resolution BioVid clip is ~600 MB decoded, its samples a few
    MB. The sample positions come from the container's frame count; if the stream turns out shorter, they are
    recomputed from the real count and the clip is read once more. Any video that cannot deliver its samples is a
    VideoFailure naming the reason.
    """
    video_path = Path(video_path)
    if not video_path.is_file():
        raise VideoFailure("missing file")
    if video_path.stat().st_size == 0:
        raise VideoFailure("empty file (0 bytes)")
    capture = cv2.VideoCapture(str(video_path))
    try:
        if not capture.isOpened():
            raise VideoFailure("unreadable: OpenCV cannot open it")
        fps = capture.get(cv2.CAP_PROP_FPS) or DEFAULT_FPS
        n_frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        capture.release()
    if n_frames <= 0:
        n_frames = count_frames(video_path)
    for _ in range(2):
        if n_frames == 0:
            raise VideoFailure("unreadable: no frame could be decoded")
        indices = sample_frame_indices(n_frames, fps, frames_per_video, start_s, end_s)
        frames = read_frames(video_path, indices)
        if len(frames) == len(indices):
            return indices, [frames[int(i)] for i in indices], fps
        n_frames = count_frames(video_path)  # the container's count was wrong: trust the stream
    raise VideoFailure(f"unreadable: frames {sorted(set(indices.tolist()) - set(frames))} could not be decoded")
