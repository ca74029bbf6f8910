"""A face followed through a video: per-frame detections turned into one box (and landmarks) per frame, smoothed so
that crops do not jitter with the detector's noise, and each frame's status: `detected`, `reused` (no detection, the
last good box reused) or `backfilled` (no detection yet, the first later good box used), as the frame table records.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.data.crop_geometry import Box
from pipeline.data.faces import Face

DETECTED, REUSED, BACKFILLED = "detected", "reused", "backfilled"


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


def smooth_faces(detections: Sequence[Face | None], alpha: float = 0.5) -> tuple[list[Face], list[str]] | None:
    """`smooth_track` for faces: the box exactly as `smooth_track` smooths it, and the landmarks (where the detector
    gives them) smoothed the same way; frames without a detection reuse the last face or take the first one."""
    boxes = [None if face is None else face.box for face in detections]
    track = smooth_track(boxes, alpha)
    if track is None:
        return None
    smoothed_boxes, statuses = track
    faces: list[Face] = []
    state: np.ndarray | None = None
    first = next(face for face in detections if face is not None)
    for face, box, status in zip(detections, smoothed_boxes, statuses, strict=True):
        if status == DETECTED and face is not None and face.landmarks is not None:
            observed = np.asarray(face.landmarks, dtype=float)
            state = observed if state is None else alpha * observed + (1.0 - alpha) * state
            faces.append(Face(box, state.copy(), face.score))
        elif status == BACKFILLED:
            faces.append(Face(box, first.landmarks, first.score))
        elif status == REUSED:
            faces.append(Face(box, faces[-1].landmarks, faces[-1].score))
        else:
            faces.append(Face(box, None, face.score if face is not None else 1.0))
    return faces, statuses


def _state_to_box(state: np.ndarray) -> Box:
    centre_x, centre_y, width, height = (float(v) for v in state)
    width, height = max(1, round(width)), max(1, round(height))
    return (round(centre_x - width / 2), round(centre_y - height / 2), width, height)
