"""Crop geometry: a face crop cut from a frame, square around a face box or aligned on five landmarks, and the 2 x 3
affine matrix that maps a frame pixel (x, y) to its crop pixel (u, v), so that anything located in the video (a
landmark, a region of the face) can be found in the crop. OpenCV's border and interpolation flags here are the crop
contract the ONNX export states.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

Box = tuple[int, int, int, int]
"""A face box: x, y, width, height in pixels of the frame it was found in."""

# How a crop is made from a frame (the ONNX export's contract states them): where a crop leaves the frame, the border
# pixels are repeated; an aligned crop is warped bilinearly; a square crop is resized with OpenCV's pixel-area average
# when it shrinks, bilinearly when it grows.
CROP_BORDER = cv2.BORDER_REPLICATE
ALIGN_INTERPOLATION = cv2.INTER_LINEAR
SQUARE_SHRINK_INTERPOLATION, SQUARE_GROW_INTERPOLATION = cv2.INTER_AREA, cv2.INTER_LINEAR


def _square(box: Box, margin: float) -> tuple[int, int, int]:
    """Left, top and side of the square that `square_crop` cuts around `box`."""
    x, y, w, h = box
    if w <= 0 or h <= 0:
        raise ValueError(f"box {box} has no area")
    side = max(1, round(max(w, h) * (1 + 2 * margin)))
    return math.floor(x + w / 2 - side / 2), math.floor(y + h / 2 - side / 2), side


def square_crop_transform(box: Box, margin: float = 0.2, size: int = 224) -> np.ndarray:
    """The 2 x 3 affine matrix mapping a frame pixel (x, y) to its pixel in `square_crop(frame, box, margin, size)`.

    Pixel centres as OpenCV's resize maps them: u = (x - left + 0.5) * size / side - 0.5.
    """
    left, top, side = _square(box, margin)
    scale = size / side
    return np.array([[scale, 0.0, (0.5 - left) * scale - 0.5], [0.0, scale, (0.5 - top) * scale - 0.5]])


def square_crop(frame: np.ndarray, box: Box, margin: float = 0.2, size: int = 224) -> np.ndarray:
    """Cut a square around the box centre with `margin` (fraction of the box side) on each side, resized to `size`.

    Where the square leaves the frame the border pixels are replicated, so faces near the edge keep their scale
    and position in the crop instead of being shifted or squashed. `square_crop_transform` says where each frame
    pixel lands.
    """
    if frame is None or frame.size == 0:
        raise ValueError("square_crop needs a non-empty frame")
    if size < 1 or margin < 0:
        raise ValueError(f"need size >= 1 and margin >= 0, got size={size}, margin={margin}")
    frame_h, frame_w = frame.shape[:2]
    left, top, side = _square(box, margin)
    right, bottom = left + side, top + side
    if right <= 0 or bottom <= 0 or left >= frame_w or top >= frame_h:
        raise ValueError(f"box {box} lies outside the {frame_w} x {frame_h} frame")
    inside = frame[max(0, top) : min(frame_h, bottom), max(0, left) : min(frame_w, right)]
    pads = (max(0, -top), max(0, bottom - frame_h), max(0, -left), max(0, right - frame_w))
    if any(pads):
        inside = cv2.copyMakeBorder(inside, *pads, borderType=CROP_BORDER)
    if side == size:
        return np.ascontiguousarray(inside)
    interpolation = SQUARE_SHRINK_INTERPOLATION if side > size else SQUARE_GROW_INTERPOLATION
    return cv2.resize(inside, (size, size), interpolation=interpolation)


# Where the five landmarks of an upright frontal face sit in its face box, as fractions of the box side: the
# widely used 112 x 112 template of face recognition (ArcFace), divided by 112. An aligned crop puts the landmarks
# here, then adds the margin around this box as `square_crop` adds it around a detector's box.
CANONICAL_LANDMARKS = np.array(
    [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]]
) / 112.0


def similarity_transform(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The least-squares similarity (rotation, uniform scale, translation; no reflection) mapping source points onto
    target points, as a 2 x 3 matrix (Umeyama's closed form: deterministic, no sampling)."""
    source, target = np.asarray(source, dtype=float), np.asarray(target, dtype=float)
    if source.shape != target.shape or source.ndim != 2 or source.shape[1] != 2 or len(source) < 2:
        raise ValueError(f"need two matching (n >= 2, 2) point arrays, got {source.shape} and {target.shape}")
    if not (np.isfinite(source).all() and np.isfinite(target).all()):
        raise ValueError("landmarks must be finite")
    source_mean, target_mean = source.mean(0), target.mean(0)
    source_centred, target_centred = source - source_mean, target - target_mean
    variance = (source_centred**2).sum() / len(source)
    if variance <= 1e-12:
        raise ValueError("the source points coincide: no transform is defined")
    covariance = target_centred.T @ source_centred / len(source)
    u, singular, vt = np.linalg.svd(covariance)
    sign = np.diag([1.0, -1.0 if np.linalg.det(u) * np.linalg.det(vt) < 0 else 1.0])
    rotation = u @ sign @ vt
    scale = float(np.trace(np.diag(singular) @ sign)) / variance
    linear = scale * rotation
    return np.hstack([linear, (target_mean - linear @ source_mean)[:, None]])


def aligned_crop_transform(landmarks: np.ndarray, margin: float = 0.2, size: int = 224) -> np.ndarray:
    """The similarity mapping a face's five landmarks (frame pixels) onto the canonical upright face of a
    `size` x `size` crop with `margin` (fraction of the face box side) on each side."""
    return similarity_transform(np.asarray(landmarks, dtype=float).reshape(5, 2), alignment_target(margin, size))


def alignment_target(margin: float = 0.2, size: int = 224) -> np.ndarray:
    """Where an aligned crop puts the five landmarks (`LANDMARK_NAMES` order, (5, 2) crop pixels x, y): the canonical
    face box with `margin` of its side on each side, scaled to `size`."""
    return (CANONICAL_LANDMARKS + margin) / (1 + 2 * margin) * size


def aligned_crop(frame: np.ndarray, landmarks: np.ndarray, margin: float = 0.2,
                 size: int = 224) -> tuple[np.ndarray, np.ndarray]:
    """An upright, scale-normalised face crop from five landmarks (`LANDMARK_NAMES` order) and the 2 x 3 matrix
    that made it (frame pixel -> crop pixel). Roll and scale differ no more between frames and people; border pixels
    are replicated where the crop leaves the frame, as in `square_crop`."""
    if frame is None or frame.size == 0:
        raise ValueError("aligned_crop needs a non-empty frame")
    if size < 1 or margin < 0:
        raise ValueError(f"need size >= 1 and margin >= 0, got size={size}, margin={margin}")
    matrix = aligned_crop_transform(landmarks, margin, size)
    crop = cv2.warpAffine(frame, matrix, (size, size), flags=ALIGN_INTERPOLATION, borderMode=CROP_BORDER)
    return crop, matrix


def apply_transform(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Points (n, 2) mapped by a 2 x 3 affine matrix (e.g. frame pixels to crop pixels)."""
    points = np.asarray(points, dtype=float).reshape(-1, 2)
    return points @ np.asarray(matrix, dtype=float)[:, :2].T + np.asarray(matrix, dtype=float)[:, 2]
