"""Face detection behind one small interface, temporal box smoothing and square face crops.

Preprocessing only needs "where is the face in this frame"; keeping that behind `FaceDetector` lets a stronger
detector (MediaPipe, RetinaFace) replace OpenCV's Haar cascade without touching the callers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import cv2
import numpy as np

from pipeline.video import VideoFailure, read_sampled_frames

Box = tuple[int, int, int, int]
"""A face box: x, y, width, height in pixels of the frame it was found in."""

DETECTED, REUSED, BACKFILLED = "detected", "reused", "backfilled"


class FaceDetector(Protocol):
    """Finds the most plausible face of a BGR frame."""

    name: str

    def detect(self, frame_bgr: np.ndarray) -> Box | None:
        """Return the most plausible (largest) face box, or None when there is no face."""
        ...


def _to_grey(frame: np.ndarray) -> np.ndarray:
    if frame is None or frame.size == 0:
        raise ValueError("face detection needs a non-empty image")
    if frame.ndim == 2:
        return frame
    if frame.ndim == 3 and frame.shape[2] == 3:
        return cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    if frame.ndim == 3 and frame.shape[2] == 4:
        return cv2.cvtColor(frame, cv2.COLOR_BGRA2GRAY)
    raise ValueError(f"expected a grey, BGR or BGRA image, got an array of shape {frame.shape}")


class HaarFaceDetector:
    """OpenCV's bundled Viola-Jones cascade: no weights to download, fast on CPU, good on frontal lab video.

    Detection runs on a grey, histogram-equalised copy downscaled so its longer side is at most `max_side`: the
    cascade's cost grows with the pixel count, and a face filling a fair part of a 1388 x 1038 frame is found just as
    well at a third of that size. Boxes are scaled back to the frame's pixels.
    """

    name = "haar"

    def __init__(
        self,
        cascade: str = "haarcascade_frontalface_default.xml",
        scale_factor: float = 1.1,
        min_neighbors: int = 5,
        min_size_fraction: float = 0.15,
        max_side: int = 480,
    ) -> None:
        if scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        if not 0.0 <= min_size_fraction < 1.0:
            raise ValueError(f"min_size_fraction must be in [0, 1), got {min_size_fraction}")
        if max_side < 24:
            raise ValueError(f"max_side must be at least the cascade's 24 px window, got {max_side}")
        cascade_path = Path(cascade) if Path(cascade).is_file() else Path(cv2.data.haarcascades) / cascade
        self.classifier = cv2.CascadeClassifier(str(cascade_path))
        if self.classifier.empty():
            raise FileNotFoundError(f"could not load Haar cascade {cascade_path}")
        self.cascade = cascade
        self.scale_factor = scale_factor
        self.min_neighbors = min_neighbors
        self.min_size_fraction = min_size_fraction
        self.max_side = max_side

    def detect(self, frame_bgr: np.ndarray) -> Box | None:
        grey = _to_grey(frame_bgr)
        height, width = grey.shape
        scale = min(1.0, self.max_side / max(height, width))
        if scale < 1.0:
            grey = cv2.resize(
                grey, (max(1, round(width * scale)), max(1, round(height * scale))), interpolation=cv2.INTER_AREA
            )
        grey = cv2.equalizeHist(grey)
        min_side = max(1, int(self.min_size_fraction * min(grey.shape)))
        faces = self.classifier.detectMultiScale(
            grey, scaleFactor=self.scale_factor, minNeighbors=self.min_neighbors, minSize=(min_side, min_side)
        )
        if len(faces) == 0:
            return None
        x, y, w, h = max(faces, key=lambda box: int(box[2]) * int(box[3]))
        x0, y0 = max(0, round(x / scale)), max(0, round(y / scale))
        x1, y1 = min(width, round((x + w) / scale)), min(height, round((y + h) / scale))
        return (x0, y0, x1 - x0, y1 - y0)


DETECTORS: dict[str, Callable[..., FaceDetector]] = {"haar": HaarFaceDetector}
"""Detector registry: name -> factory taking the detector's keyword arguments."""


def register_detector(name: str, factory: Callable[..., FaceDetector]) -> None:
    """Make a detector available to `build_detector` (and so to the config) under `name`."""
    if name in DETECTORS:
        raise ValueError(f"a face detector named {name!r} is already registered")
    DETECTORS[name] = factory


def build_detector(name: str = "haar", **kwargs) -> FaceDetector:
    """Build a registered detector by name, passing `kwargs` to its constructor."""
    if name not in DETECTORS:
        raise ValueError(f"unknown face detector {name!r}; registered: {', '.join(sorted(DETECTORS))}")
    return DETECTORS[name](**kwargs)


def smooth_track(detections: Sequence[Box | None], alpha: float = 0.5) -> tuple[list[Box], list[str]] | None:
    """Turn per-frame detections into one box per frame, and say where each box came from.

    Box centre and size are smoothed exponentially (`alpha` is the weight of the new detection; 1 = no smoothing) so
    crops do not jitter with the detector's noise. A frame without a detection reuses the last box ("reused"); frames
    before the first detection take the first detected box ("backfilled"). None when no frame has a detection.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    first = next((index for index, box in enumerate(detections) if box is not None), None)
    if first is None:
        return None
    boxes: list[Box] = []
    statuses: list[str] = []
    state: np.ndarray | None = None  # centre x, centre y, width, height
    for index, box in enumerate(detections):
        if box is not None:
            x, y, w, h = box
            observed = np.array([x + w / 2, y + h / 2, w, h], dtype=float)
            state = observed if state is None else alpha * observed + (1.0 - alpha) * state
            boxes.append(_state_to_box(state))
            statuses.append(DETECTED)
        elif index < first:
            boxes.append(tuple(int(v) for v in detections[first]))  # type: ignore[arg-type]
            statuses.append(BACKFILLED)
        else:
            boxes.append(boxes[-1])
            statuses.append(REUSED)
    return boxes, statuses


def _state_to_box(state: np.ndarray) -> Box:
    centre_x, centre_y, width, height = (float(v) for v in state)
    width, height = max(1, round(width)), max(1, round(height))
    return (round(centre_x - width / 2), round(centre_y - height / 2), width, height)


def square_crop(frame: np.ndarray, box: Box, margin: float = 0.2, size: int = 224) -> np.ndarray:
    """Cut a square around the box centre with `margin` (fraction of the box side) on each side, resized to `size`.

    Where the square leaves the frame the border pixels are replicated, so faces near the edge keep their scale
    and position in the crop instead of being shifted or squashed.
    """
    if frame is None or frame.size == 0:
        raise ValueError("square_crop needs a non-empty frame")
    if size < 1 or margin < 0:
        raise ValueError(f"need size >= 1 and margin >= 0, got size={size}, margin={margin}")
    x, y, w, h = box
    if w <= 0 or h <= 0:
        raise ValueError(f"box {box} has no area")
    frame_h, frame_w = frame.shape[:2]
    side = max(1, round(max(w, h) * (1 + 2 * margin)))
    left = math.floor(x + w / 2 - side / 2)
    top = math.floor(y + h / 2 - side / 2)
    right, bottom = left + side, top + side
    if right <= 0 or bottom <= 0 or left >= frame_w or top >= frame_h:
        raise ValueError(f"box {box} lies outside the {frame_w} x {frame_h} frame")
    inside = frame[max(0, top) : min(frame_h, bottom), max(0, left) : min(frame_w, right)]
    pads = (max(0, -top), max(0, bottom - frame_h), max(0, -left), max(0, right - frame_w))
    if any(pads):
        inside = cv2.copyMakeBorder(inside, *pads, borderType=cv2.BORDER_REPLICATE)
    if side == size:
        return np.ascontiguousarray(inside)
    interpolation = cv2.INTER_AREA if side > size else cv2.INTER_LINEAR
    return cv2.resize(inside, (size, size), interpolation=interpolation)


def detection_rate(
    video_paths: Iterable[str | Path],
    detector: FaceDetector,
    frames_per_video: int = 8,
    start_s: float = 2.0,
    end_s: float | None = None,
) -> dict:
    """Fraction of sampled frames in which `detector` finds a face, over the frames preprocessing would crop.

    Frames are chosen and decoded exactly as preprocessing does (`pipeline.video.read_sampled_frames`), so a video
    that preprocessing would reject (too short for the window, undecodable) contributes no frames and is listed
    under "failed" with the reason. Returns {"overall", "n_frames", "n_detected", "per_video": {path: fraction},
    "failed": {path: reason}}. A path that does not exist is an error.
    """
    per_video: dict[str, float] = {}
    failed: dict[str, str] = {}
    total = detected = 0
    for path in video_paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"video not found: {path}")
        try:
            _, frames, _ = read_sampled_frames(path, frames_per_video, start_s, end_s)
        except VideoFailure as failure:
            failed[str(path)] = str(failure)
            continue
        hits = sum(detector.detect(frame) is not None for frame in frames)
        per_video[str(path)] = hits / len(frames)
        total += len(frames)
        detected += hits
    return {
        "overall": detected / total if total else 0.0,
        "n_frames": total,
        "n_detected": detected,
        "per_video": per_video,
        "failed": failed,
    }
