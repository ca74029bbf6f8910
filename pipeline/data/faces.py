"""Face detection behind one small interface: where the face is in a frame, and where its eyes, nose and mouth are.

Keeping that behind `FaceDetector` lets detectors be swapped by name (`haar`: OpenCV's cascade, box only; `mtcnn`:
MTCNN, box and five landmarks, batched, on the GPU when there is one; `blazeface`: MediaPipe's BlazeFace full-range,
box and six keypoints mapped onto the five, on the CPU) without touching the callers. `face_rows` asks any of them for
every face of a frame, as MTCNN gives them (what `make predict` follows and falls back on); `retry_rotated` searches
the frames without a face again, rotated.

A face followed through a video is `pipeline.data.face_tracks`'; the crops cut around it are
`pipeline.data.crop_geometry`'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import cv2
import numpy as np

from pipeline.data.crop_geometry import CANONICAL_LANDMARKS, Box, apply_transform, similarity_transform
from pipeline.data.video import VideoFailure, read_sampled_frames

LANDMARK_NAMES = ("eye_left", "eye_right", "nose", "mouth_left", "mouth_right")
"""The five landmarks, in this order. Left and right are the image's: `eye_left` is the person's right eye."""


@dataclass(frozen=True, eq=False)
class Face:
    """One face in one frame: its box (x, y, width, height) and, if the detector gives them, the five landmarks
    (`LANDMARK_NAMES` order, an array of shape (5, 2) of x, y), all in pixels of the frame."""

    box: tuple[float, float, float, float]
    landmarks: np.ndarray | None = None
    score: float = 1.0


class FaceDetector(Protocol):
    """Finds the most plausible face of BGR frames."""

    name: str
    gives_landmarks: bool

    def detect(self, frame_bgr: np.ndarray) -> Box | None:
        """Return the most plausible (largest) face box, or None when there is no face."""
        ...

    def detect_faces(self, frames_bgr: Sequence[np.ndarray]) -> list[Face | None]:
        """The most plausible (largest) face of each frame, or None where there is none; one call per video."""
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
    gives_landmarks = False

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
        bundled = cv2.data.haarcascades  # type: ignore[attr-defined]  # OpenCV's stubs lack cv2.data
        cascade_path = Path(cascade) if Path(cascade).is_file() else Path(bundled) / cascade
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

    def detect_faces(self, frames_bgr: Sequence[np.ndarray]) -> list[Face | None]:
        return [None if box is None else Face(box) for box in map(self.detect, frames_bgr)]


def find_faces(detector: FaceDetector, frames_bgr: Sequence[np.ndarray]) -> list[Face | None]:
    """`detector.detect_faces(frames)`; a registered detector that only has `detect` is asked frame by frame."""
    if hasattr(detector, "detect_faces"):
        return detector.detect_faces(frames_bgr)
    return [None if box is None else Face(box) for box in map(detector.detect, frames_bgr)]


def resolve_device(device: str) -> str:
    """"auto" is the GPU when torch sees one, else the CPU; anything else is passed on ("cpu", "cuda", "cuda:1")."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class MTCNNFaceDetector:
    """MTCNN (`pipeline.data.mtcnn`): a face box and five landmarks per frame, from real faces rotated by +-20 degrees
    and more, small faces and uneven light that the frontal Haar cascade misses.

    A video's frames are detected in batches of `batch_size` on `device` ("auto": the GPU when there is one).
    Frames are halved until their longer side is at most `max_side` before detection; faces smaller than
    `min_size_fraction` of the frame's shorter side are not searched for.
    """

    name = "mtcnn"
    gives_landmarks = True

    def __init__(
        self,
        device: str = "auto",
        min_size_fraction: float = 0.1,
        max_side: int = 720,
        thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
        batch_size: int = 16,
    ) -> None:
        from pipeline.data.mtcnn import MTCNN

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.network = MTCNN(self.device, tuple(thresholds), min_size_fraction, max_side)

    def detect_faces(self, frames_bgr: Sequence[np.ndarray]) -> list[Face | None]:
        """The most plausible face of each frame (`plausibility`), with its landmarks and score."""
        faces: list[Face | None] = []
        for start in range(0, len(frames_bgr), self.batch_size):
            batch = [_to_bgr(frame) for frame in frames_bgr[start : start + self.batch_size]]
            faces += [best_face(found) for found in self.network.detect(batch)]
        return faces

    def detect(self, frame_bgr: np.ndarray) -> Box | None:
        return _frame_box(self.detect_faces([frame_bgr])[0], frame_bgr.shape)


def plausibility(found: np.ndarray) -> np.ndarray:
    """Rank MTCNN's faces (rows x1, y1, x2, y2, score, ...): the largest of those about as confident as the most
    confident one. Not simply the largest: a torso or a patterned shirt can pass as a big face with a low score
    (0.7-0.96, where the real face scores > 0.99)."""
    area = (found[:, 2] - found[:, 0]) * (found[:, 3] - found[:, 1])
    return np.where(found[:, 4] >= found[:, 4].max() - 0.02, area, -1.0)


def _to_bgr(frame: np.ndarray) -> np.ndarray:
    if frame is None or frame.size == 0:
        raise ValueError("face detection needs a non-empty image")
    if frame.ndim == 2:
        return cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
    if frame.ndim == 3 and frame.shape[2] == 3:
        return frame
    if frame.ndim == 3 and frame.shape[2] == 4:
        return cv2.cvtColor(frame, cv2.COLOR_BGRA2BGR)
    raise ValueError(f"expected a grey, BGR or BGRA image, got an array of shape {frame.shape}")


class TwinGeometry:
    """`truth`: not a detector but the synthetic twin's own geometry, which places the face and its five landmarks
    where the generator drew them (`pipeline.data.synthetic.truth_crops`, `data.synthetic.crops=truth`). Named here so
    that crop settings can record it; it cannot search a frame."""

    gives_landmarks = True

    def __init__(self, **_: object) -> None:
        raise ValueError("the 'truth' face detector is the synthetic twin's own geometry (data.synthetic.crops=truth): "
                         "it places faces in the twin's frames, it cannot search a video; use mtcnn or haar")



def five_landmarks(eye_left: np.ndarray, eye_right: np.ndarray, nose: np.ndarray, mouth: np.ndarray) -> np.ndarray:
    """The five landmarks (`LANDMARK_NAMES`) of a detector that places the mouth's centre instead of its corners: the
    canonical face (`CANONICAL_LANDMARKS`, its mouth centre the corners' mean) fitted to the four points given, and
    the corners put where the fit puts the canonical ones. The fit uses every point for the face's roll, not only the
    eye line: the eyes of a face turned to three-quarter view are close together, and their line alone is noisy."""
    given = np.stack([eye_left, eye_right, nose, mouth]).astype(float)
    canonical = np.vstack([CANONICAL_LANDMARKS[:3], CANONICAL_LANDMARKS[3:].mean(axis=0)])
    corners = apply_transform(similarity_transform(canonical, given), CANONICAL_LANDMARKS[3:])
    return np.vstack([given[:3], corners])


class BlazeFaceDetector:
    """BlazeFace full-range (`pipeline.data.blazeface`): finds the small faces of wide shots, and faces MTCNN loses in
    soft, grainy, low-contrast footage (old black-and-white recordings); runs on the CPU (LiteRT), about 20 ms a
    view. Its eyes and nose are the five landmarks' own; the mouth corners are placed about its mouth centre
    (`five_landmarks`). Faces smaller than `min_size_fraction` of the frame's shorter side are dropped."""

    name = "blazeface"
    gives_landmarks = True

    def __init__(self, min_size_fraction: float = 0.1, score_threshold: float = 0.5, tiles: int = 2) -> None:
        from pipeline.data.blazeface import BlazeFace

        if not 0.0 <= min_size_fraction < 1.0:
            raise ValueError(f"min_size_fraction must be in [0, 1), got {min_size_fraction}")
        self.min_size_fraction = min_size_fraction
        self.network = BlazeFace(score_threshold=score_threshold, tiles=tiles)

    def detect_rows(self, frames_bgr: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every face of each frame as MTCNN's rows (x1, y1, x2, y2, score, 5 landmark x, 5 landmark y)."""
        found = []
        for frame in frames_bgr:
            frame = _to_bgr(frame)
            raw = self.network.detect(frame)
            rows = np.empty((len(raw), 15))
            for row, face in zip(rows, raw, strict=True):
                points = np.stack([face[5:11], face[11:17]], axis=1)
                landmarks = five_landmarks(*points[:4])
                row[:5], row[5:10], row[10:15] = face[:5], landmarks[:, 0], landmarks[:, 1]
            smallest = self.min_size_fraction * min(frame.shape[:2])
            found.append(rows[(rows[:, 3] - rows[:, 1]) >= smallest])
        return found

    def detect_faces(self, frames_bgr: Sequence[np.ndarray]) -> list[Face | None]:
        return [best_face(rows) for rows in self.detect_rows(frames_bgr)]

    def detect(self, frame_bgr: np.ndarray) -> Box | None:
        return _frame_box(self.detect_faces([frame_bgr])[0], frame_bgr.shape)


def best_face(rows: np.ndarray) -> Face | None:
    """The most plausible (`plausibility`) of MTCNN-layout rows as a `Face`; None without rows."""
    if not len(rows):
        return None
    best = rows[np.argmax(plausibility(rows))]
    x1, y1, x2, y2, score = best[:5]
    return Face((float(x1), float(y1), float(x2 - x1), float(y2 - y1)), np.stack([best[5:10], best[10:15]], axis=1),
                float(score))


def _frame_box(face: Face | None, shape: tuple[int, ...]) -> Box | None:
    if face is None:
        return None
    height, width = shape[:2]
    x, y, w, h = face.box
    x0, y0 = max(0, round(x)), max(0, round(y))
    return (x0, y0, min(width, round(x + w)) - x0, min(height, round(y + h)) - y0)


def face_rows(detector: FaceDetector, frames_bgr: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Every face of each frame as MTCNN's rows (x1, y1, x2, y2, score, 5 landmark x, 5 landmark y; NaN landmarks
    for a box-only detector): `detect_rows` where the detector has it, else its one face per frame."""
    if hasattr(detector, "detect_rows"):
        return detector.detect_rows(frames_bgr)
    rows = []
    for face in find_faces(detector, frames_bgr):
        if face is None:
            rows.append(np.empty((0, 15)))
            continue
        x, y, w, h = face.box
        points = np.full((5, 2), np.nan) if face.landmarks is None else np.asarray(face.landmarks, float)
        rows.append(np.array([[x, y, x + w, y + h, face.score, *points[:, 0], *points[:, 1]]]))
    return rows


DETECTORS: dict[str, Callable[..., FaceDetector]] = {"haar": HaarFaceDetector, "mtcnn": MTCNNFaceDetector,
                                                    "blazeface": BlazeFaceDetector, "truth": TwinGeometry}
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


def gives_landmarks(name: str) -> bool:
    """Whether the registered detector `name` places landmarks (needed to align crops)."""
    if name not in DETECTORS:
        raise ValueError(f"unknown face detector {name!r}; registered: {', '.join(sorted(DETECTORS))}")
    return bool(getattr(DETECTORS[name], "gives_landmarks", False))


def detection_rate(
    video_paths: Iterable[str | Path],
    detector: FaceDetector,
    frames_per_video: int = 8,
    start_s: float = 2.0,
    end_s: float | None = None,
) -> dict:
    """Fraction of sampled frames in which `detector` finds a face, over the frames preprocessing would crop.

    Frames are chosen and decoded exactly as preprocessing does (`pipeline.data.video.read_sampled_frames`), so a video
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
        hits = sum(face is not None for face in find_faces(detector, frames))
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


def rotated(frame: np.ndarray, angle_deg: float) -> tuple[np.ndarray, np.ndarray]:
    """`frame` rotated by `angle_deg` (counter-clockwise on screen) about its centre, at its own size (the corners
    that leave the frame are lost, the ones that enter repeat the border: a face is rarely in a corner, and the
    detector keeps its resolution), and the 2 x 3 matrix that maps the rotated frame's points back to the frame's."""
    height, width = frame.shape[:2]
    matrix = cv2.getRotationMatrix2D((width / 2, height / 2), angle_deg, 1.0)
    turned = cv2.warpAffine(frame, matrix, (width, height), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    return turned, cv2.invertAffineTransform(matrix)


def map_faces(rows: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """MTCNN rows (x1, y1, x2, y2, score, 5 landmark x, 5 landmark y) moved by a 2 x 3 affine `matrix`: the landmarks
    exactly, the box as the upright box around its four moved corners."""
    out = rows.copy()
    for row, face in zip(out, rows, strict=True):
        x1, y1, x2, y2 = face[:4]
        corners = apply_transform(matrix, np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], np.float64))
        row[:2], row[2:4] = corners.min(axis=0), corners.max(axis=0)
        if np.isfinite(face[5:15]).all():
            points = apply_transform(matrix, np.stack([face[5:10], face[10:15]], axis=1))
            row[5:10], row[10:15] = points[:, 0], points[:, 1]
    return out


def retry_rotated(detect: Callable[[list[np.ndarray]], list[np.ndarray]], frames_bgr: Sequence[np.ndarray],
                  found: list[np.ndarray], rolls_deg: Sequence[float] = (25.0, -25.0, 50.0, -50.0)) -> list[np.ndarray]:
    """Frames where `detect` (MTCNN's: frames -> rows per frame) found no face, detected again rotated by each roll in
    turn until a face is found; its rows are mapped back to the frame. MTCNN's networks saw faces rolled up to about
    +-30 degrees: a head rolled further, or rolled and small, is found upright."""
    found = list(found)
    for angle in rolls_deg:
        missed = [index for index, rows in enumerate(found) if not len(rows)]
        if not missed:
            break
        turned = [rotated(frames_bgr[index], angle) for index in missed]
        for index, (_, back), rows in zip(missed, turned, detect([frame for frame, _ in turned]), strict=True):
            if len(rows):
                found[index] = map_faces(rows, back)
    return found
