"""One sample's outputs: its frames (rendered with the look's renderer), the encoded mp4, and the per-frame
table of action units, pose and PSPI region boxes written beside it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pandas as pd

from pipeline.data.synthetic.animation import animate
from pipeline.data.synthetic.classic_renderer import FaceRenderer
from pipeline.data.synthetic.drawing import face_transform, yawed_frames
from pipeline.data.synthetic.hard_renderer import HardFaceRenderer
from pipeline.data.synthetic.roster import Sample, Subject
from pipeline.data.synthetic.settings import REGIONS_DIR, VIDEO_STREAM, SyntheticConfig, seeded_rng
from pipeline.utils.atomic_io import atomic_path


def canvas_size(config: SyntheticConfig) -> tuple[int, int]:
    """The size frames are drawn at: the output size, or smaller (then upscaled) past `render_max_side`."""
    scale = min(1.0, config.render_max_side / max(config.width, config.height))
    return max(64, round(config.width * scale)), max(48, round(config.height * scale))


def render_frames(config: SyntheticConfig, subject: Subject, sample: Sample) -> Iterator[np.ndarray]:
    """The video's frames at the output size, deterministic from (seed, subject, sample)."""
    rng = seeded_rng(config.seed, VIDEO_STREAM, subject.subject_id, sample.number, 1)
    action_units, pose = animate(config, subject, sample, rng)
    width, height = canvas_size(config)
    renderer_class = HardFaceRenderer if config.difficulty == "hard" else FaceRenderer
    renderer = renderer_class(subject, width, height, pose[0], config.noise_sigma, rng)
    noise_order = rng.integers(0, len(renderer.noise), config.n_frames)
    for index in range(config.n_frames):
        frame = renderer.render(action_units[index], pose[index], int(noise_order[index]))
        if (width, height) != (config.width, config.height):
            frame = cv2.resize(frame, (config.width, config.height), interpolation=cv2.INTER_LINEAR)
        yield frame


def video_is_complete(path: Path, config: SyntheticConfig) -> bool:
    """A finished video: opens, and has the configured size and frame count."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    capture = cv2.VideoCapture(str(path))
    try:
        return (
            capture.isOpened()
            and int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == config.n_frames
            and int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)) == config.width
            and int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)) == config.height
        )
    finally:
        capture.release()


def write_video(path: Path, config: SyntheticConfig, subject: Subject, sample: Sample) -> None:
    """Render and encode one video atomically (a temp .mp4 beside it, renamed when complete)."""
    remove_stale(path)
    with atomic_path(path) as tmp:
        encode_video(tmp, config, subject, sample)


def remove_stale(path: Path) -> None:
    """Delete the temporary files a killed run left beside `path`."""
    for stale in path.parent.glob(f".{path.stem}.*{path.suffix}"):
        stale.unlink(missing_ok=True)


def encode_video(path: Path, config: SyntheticConfig, subject: Subject, sample: Sample) -> None:
    """Render one video and encode it into `path` (as it is: the caller makes it atomic)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*config.fourcc), config.fps,
                             (config.width, config.height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {config.fourcc} video to {path}")
    try:
        for frame in render_frames(config, subject, sample):
            writer.write(frame)
    finally:
        writer.release()


def _region_outlines(subject: Subject) -> dict[str, np.ndarray]:
    """Each PSPI region as an outline in face-local coordinates, covering the feature over its whole range of
    motion (brows lowered, cheeks raised, lip raised)."""
    reach = subject.eye_spacing + subject.eye_width
    rectangles = {
        "brows": (-0.75, -0.5, 0.75, -0.12),  # AU4: brow lowering, the furrows between the brows
        "orbits": (-(reach + 0.12), -0.22, reach + 0.12, 0.2),  # AU6/7: orbit tightening, the cheek furrows
        "nose_lip": (-0.32, -0.1, 0.32, 0.9),  # AU9/10: nose wrinkle, upper-lip raise
        "eyes": (-reach, -0.12, reach, 0.08),  # AU43: eye closure
    }
    edge = np.linspace(0.0, 1.0, 5)
    outlines = {}
    for name, (u0, v0, u1, v1) in rectangles.items():
        u, v = u0 + (u1 - u0) * edge, v0 + (v1 - v0) * edge
        outlines[name] = np.concatenate([np.stack([u, np.full(5, v0)], 1), np.stack([u, np.full(5, v1)], 1),
                                         np.stack([np.full(5, u0), v], 1), np.stack([np.full(5, u1), v], 1)])
    return outlines


def face_regions(config: SyntheticConfig, subject: Subject, sample: Sample) -> pd.DataFrame:
    """Per frame of the video: the action units, head roll and yaw, and each PSPI region's box in video pixels
    (`<region>_x0, _y0, _x1, _y1`), computed from the same animation the video is rendered from."""
    rng = seeded_rng(config.seed, VIDEO_STREAM, subject.subject_id, sample.number, 1)
    action_units, pose = animate(config, subject, sample, rng)
    width, height = canvas_size(config)
    upscale = np.array([config.width / width, config.height / height])
    outlines = _region_outlines(subject)
    table: dict[str, object] = {"frame_index": np.arange(config.n_frames),
                                "time_s": [round(index / config.fps, 4) for index in range(config.n_frames)]}
    table |= dict(zip(("au4", "au6_7", "au9_10", "au43"), np.round(action_units, 4).T, strict=True))
    table |= {name: [round(math.degrees(angle), 3) for angle in pose[:, column]]
              for name, column in (("roll_deg", 2), ("yaw_deg", 4))}
    transforms = [face_transform(subject, width, height, frame_pose) for frame_pose in pose]
    linear = np.stack([matrix for matrix, _ in transforms])
    offset = np.stack([shift for _, shift in transforms])[:, None, :]
    for name, outline in outlines.items():
        local = yawed_frames(outline, pose[:, 4], subject.face_aspect)
        pixels = (local @ linear.transpose(0, 2, 1) + offset + 0.5) * upscale - 0.5  # canvas -> video pixels
        low, high = pixels.min(1), pixels.max(1)
        table |= {f"{name}_x0": low[:, 0], f"{name}_y0": low[:, 1], f"{name}_x1": high[:, 0], f"{name}_y1": high[:, 1]}
    return pd.DataFrame(table).round(2)


def regions_path(root: Path, subject_name: str, sample_name: str) -> Path:
    """Where a video's per-frame action units and PSPI regions are: beside starting_point/, not inside video/."""
    return Path(root) / REGIONS_DIR / subject_name / f"{sample_name}.csv"
