"""Video clips of a real face: a photograph's head and shoulders pasted at a chosen size, roll, brightness and
background, moving a few pixels from frame to frame.

The synthetic twin's faces are drawn; these clips put a detector in front of a real face, with the variation that
decides whether a frontal detector finds it (how large the face is in the frame, how far the head is rolled, how
bright the picture is, what lies behind the head). The photograph is scikit-image's astronaut (public domain),
which the test extras install; any photograph with its face box works.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from pipeline.utils.atomic_io import atomic_path

# The face box (x, y, width, height) in scikit-image's astronaut photograph, as MTCNN finds it: brows to chin.
ASTRONAUT_FACE_BOX = (181.0, 64.5, 84.7, 108.6)


def astronaut() -> np.ndarray:
    """scikit-image's astronaut photograph (512 x 512), BGR."""
    from skimage import data

    return cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)


@dataclass(frozen=True)
class PhotoClip:
    """One clip: the face's height as a fraction of the frame's, its roll, brightness gain and background colour."""

    face_fraction: float
    roll_deg: float = 0.0
    brightness: float = 1.0
    background: tuple[int, int, int] = (128, 128, 128)  # BGR
    width: int = 694
    height: int = 519
    n_frames: int = 4
    fps: int = 25
    motion_px: float = 3.0  # the head drifts by up to this many pixels
    seed: int = 0

    @property
    def name(self) -> str:
        b, g, r = self.background
        return (f"face{round(100 * self.face_fraction):02d}_roll{self.roll_deg:+03.0f}_light{self.brightness:.2f}"
                f"_bg{b:02x}{g:02x}{r:02x}")


def head_and_shoulders_mask(shape: tuple[int, int], face_box: tuple[float, float, float, float]) -> np.ndarray:
    """A soft mask (float, 0..1) over the head and shoulders around `face_box`: a head oval and a wider torso."""
    height, width = shape
    x, y, w, h = face_box
    centre_x, centre_y = x + w / 2, y + h / 2
    mask = np.zeros((height, width), np.float32)
    cv2.ellipse(mask, (round(centre_x), round(centre_y - 0.12 * h)), (round(0.95 * w), round(0.9 * h)), 0, 0, 360,
                1.0, -1)
    cv2.ellipse(mask, (round(centre_x), round(centre_y + 2.1 * h)), (round(2.2 * w), round(1.6 * h)), 0, 0, 360,
                1.0, -1)
    cv2.rectangle(mask, (round(centre_x - 0.45 * w), round(centre_y)), (round(centre_x + 0.45 * w),
                  round(centre_y + 1.2 * h)), 1.0, -1)  # neck
    return cv2.GaussianBlur(mask, (0, 0), 0.04 * w)


def clip_frames(photo: np.ndarray, clip: PhotoClip,
                face_box: tuple[float, float, float, float] = ASTRONAUT_FACE_BOX) -> list[np.ndarray]:
    """The clip's frames: the head and shoulders of `photo` scaled so the face box is `face_fraction` of the frame
    height, rolled by `roll_deg` about the face centre, lit by `brightness`, over a plain `background`."""
    x, y, w, h = face_box
    face_centre = (x + w / 2, y + h / 2)
    scale = clip.face_fraction * clip.height / h
    mask = head_and_shoulders_mask(photo.shape[:2], face_box)
    lit = np.clip(photo.astype(np.float32) * clip.brightness, 0, 255)
    rng = np.random.default_rng(clip.seed)
    phase = rng.uniform(0, 2 * math.pi, 2)
    background = np.empty((clip.height, clip.width, 3), np.float32)
    background[:] = clip.background
    frames = []
    for index in range(clip.n_frames):
        drift = clip.motion_px * np.sin(2 * math.pi * 0.7 * index / clip.fps + phase)
        target = (clip.width / 2 + drift[0], 0.45 * clip.height + drift[1])
        matrix = photo_transform(face_centre, clip.roll_deg, scale, target)
        size = (clip.width, clip.height)
        head = cv2.warpAffine(lit, matrix, size, flags=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
        alpha = cv2.warpAffine(mask, matrix, size, flags=cv2.INTER_LINEAR)[..., None]
        frame = head * alpha + background * (1 - alpha)
        frame += rng.normal(0.0, 2.0, frame.shape[:2])[..., None]  # sensor noise
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
    return frames


def old_photograph(frame: np.ndarray, seed: int = 0, softness: int = 3, contrast: float = 0.5,
                   grain: float = 12.0) -> np.ndarray:
    """`frame` as an old black-and-white photograph looks when it is filmed: soft (detail of a picture `softness`
    times smaller, enlarged), flat (`contrast` about mid-grey) and grainy (Gaussian grain of `grain` grey levels,
    drawn anew each frame from `seed`)."""
    height, width = frame.shape[:2]
    picture = frame.astype(np.float32)
    if softness > 1:
        small = cv2.resize(picture, (width // softness, height // softness), interpolation=cv2.INTER_AREA)
        picture = cv2.resize(small, (width, height), interpolation=cv2.INTER_LINEAR)
    picture = (picture - 128.0) * contrast + 128.0
    picture += np.random.default_rng(seed).normal(0.0, grain, (height, width))[..., None]
    return np.clip(picture, 0, 255).astype(np.uint8)


def photo_transform(face_centre: tuple[float, float], roll_deg: float, scale: float,
                    target: tuple[float, float]) -> np.ndarray:
    """The 2 x 3 matrix that puts the photo's face centre at `target`, scaled and rolled (positive: clockwise on
    screen, the head leaning to the image's right)."""
    matrix = cv2.getRotationMatrix2D(face_centre, -roll_deg, scale)
    matrix[:, 2] += np.array(target) - np.array(face_centre)
    return matrix


def write_clip(path: Path, frames: Iterable[np.ndarray], fps: int = 25) -> None:
    """Encode frames as an mp4 (mp4v), atomically."""
    frames = list(frames)
    height, width = frames[0].shape[:2]
    with atomic_path(path) as tmp:
        writer = cv2.VideoWriter(str(tmp), cv2.VideoWriter.fourcc(*"mp4v"), fps, (width, height))
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV cannot write mp4v video to {tmp}")
        try:
            for frame in frames:
                writer.write(frame)
        finally:
            writer.release()


def clip_grid(face_fractions: Iterable[float], rolls_deg: Iterable[float], brightness: Iterable[float],
              backgrounds: Iterable[tuple[int, int, int]], **clip_options) -> list[PhotoClip]:
    """Every combination of the given sizes, rolls, brightness gains and backgrounds (seeded by position)."""
    grid = [(f, r, b, bg) for f in face_fractions for r in rolls_deg for b in brightness for bg in backgrounds]
    return [PhotoClip(f, r, b, tuple(bg), seed=index, **clip_options) for index, (f, r, b, bg) in enumerate(grid)]


def write_clips(folder: Path, clips: Iterable[PhotoClip], photo: np.ndarray | None = None) -> dict[PhotoClip, Path]:
    """Write every clip as `<folder>/<clip name>.mp4` (an existing file is kept); returns clip -> path."""
    photo = astronaut() if photo is None else photo
    paths = {}
    for clip in clips:
        path = Path(folder) / f"{clip.name}.mp4"
        if not path.is_file():
            write_clip(path, clip_frames(photo, clip), clip.fps)
        paths[clip] = path
    return paths
