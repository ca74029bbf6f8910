"""Face crops of a twin made from its own geometry: the sampled frames are drawn and cropped where the generator put
the face, with no video written, decoded or searched (`data.synthetic.crops=truth`).

The generator knows every frame's face-local -> pixel map and head pose, so it knows where the five landmarks
(`pipeline.data.faces.LANDMARK_NAMES`) are; the crop is then made exactly as for a detected face (aligned on the
landmarks, or square around their box) and written in the layout `make data` writes (crops, one frame table per video,
frames.csv, failures.csv, preprocess.json with `detector: truth`). Only the frames a crop is made of are drawn:
about 17 times fewer than a whole clip, and no MTCNN, so a BioVid-scale twin's crops take a minute instead of ten.
What it leaves out is what a detector adds: missed faces, jittering boxes, landmarks a few pixels off. It serves
`make power`, which needs many independent twins, and anyone who wants a twin's crops fast; the numbers of a CV on
truth crops are not those of the same twin through MTCNN (the crops' preprocess.json and the CV's crop settings say
which).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from tqdm import tqdm

from pipeline.data.crop_geometry import aligned_crop, square_crop, square_crop_transform
from pipeline.data.face_crops import (
    FRAME_COLUMNS,
    PreprocessConfig,
    PreprocessResult,
    check_config,
    video_table_path,
)
from pipeline.data.synthetic.animation import animate
from pipeline.data.synthetic.classic_renderer import FaceRenderer
from pipeline.data.synthetic.drawing import face_transform, yawed
from pipeline.data.synthetic.hard_renderer import HardFaceRenderer
from pipeline.data.synthetic.roster import Sample, Subject, make_samples, make_subjects
from pipeline.data.synthetic.settings import VIDEO_STREAM, SyntheticConfig, seeded_rng
from pipeline.data.synthetic.videos import canvas_size
from pipeline.data.tasks import CLASS_NAMES
from pipeline.data.video import sample_frame_indices
from pipeline.utils.atomic_io import atomic_write_bytes, atomic_write_csv
from pipeline.utils.cpus import available_cpus, process_pool

DETECTOR = "truth"  # preprocess.json's detector and the frame rows' `detection` of truth crops


def landmarks_of(subject: Subject, pose: np.ndarray, width: int, height: int, upscale: np.ndarray) -> np.ndarray:
    """The five landmarks (eyes, nose tip, mouth corners: `LANDMARK_NAMES` order, the viewer's left first) of a
    frame, in output pixels: where the renderers draw them, through the frame's pose and yaw."""
    local = np.array([[-subject.eye_spacing, -0.02], [subject.eye_spacing, -0.02], [0.0, 0.47],
                      [-subject.mouth_width, 0.82], [subject.mouth_width, 0.82]])
    if pose[4]:
        local = yawed(local, float(pose[4]), subject.face_aspect)
    linear, offset = face_transform(subject, width, height, pose)
    return (local @ linear.T + offset + 0.5) * upscale - 0.5  # canvas -> output pixels (resize's pixel centres)


def sampled_frames(config: SyntheticConfig, subject: Subject, sample: Sample,
                   indices: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(frame index, frame at the output size, landmarks) of the sampled frames, drawn as `render_frames` draws
    them (the same random streams: frame i here is frame i of the video)."""
    rng = seeded_rng(config.seed, VIDEO_STREAM, subject.subject_id, sample.number, 1)
    action_units, pose = animate(config, subject, sample, rng)
    width, height = canvas_size(config)
    renderer_class = HardFaceRenderer if config.difficulty == "hard" else FaceRenderer
    renderer = renderer_class(subject, width, height, pose[0], config.noise_sigma, rng)
    noise_order = rng.integers(0, len(renderer.noise), config.n_frames)
    upscale = np.array([config.width / width, config.height / height])
    out = []
    for index in indices:
        frame = renderer.render(action_units[index], pose[index], int(noise_order[index]))
        if (width, height) != (config.width, config.height):
            frame = cv2.resize(frame, (config.width, config.height), interpolation=cv2.INTER_LINEAR)
        out.append((int(index), frame, landmarks_of(subject, pose[index], width, height, upscale)))
    return out


def crop_sample(job: tuple[SyntheticConfig, Subject, Sample, str, PreprocessConfig, Path]) -> pd.DataFrame:
    """One video's truth crops and frame rows (the video's table written last, as `make data`'s 'done' marker)."""
    config, subject, sample, subject_name, preprocess, out_dir = job
    indices = sample_frame_indices(config.n_frames, config.fps, preprocess.frames_per_video, preprocess.start_s,
                                   preprocess.end_s)
    relative_dir = Path("crops") / subject_name / sample.sample_name
    rows = []
    for index, frame, landmarks in sampled_frames(config, subject, sample, indices):
        low, high = landmarks.min(0), landmarks.max(0)
        side = float(max(high - low)) * 1.6  # a box of the face around its landmarks, for the square crop
        box = (float((low[0] + high[0] - side) / 2), float((low[1] + high[1] - side) / 2), side, side)
        if preprocess.align:
            crop, matrix = aligned_crop(frame, landmarks, margin=preprocess.margin, size=preprocess.crop_size)
        else:
            crop = square_crop(frame, box, margin=preprocess.margin, size=preprocess.crop_size)
            matrix = square_crop_transform(box, margin=preprocess.margin, size=preprocess.crop_size)
        ok, encoded = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, preprocess.jpeg_quality])
        if not ok:
            raise RuntimeError(f"JPEG encoding failed for {sample.sample_name} frame {index}")
        crop_path = relative_dir / f"f{index:03d}.jpg"
        atomic_write_bytes(out_dir / crop_path, encoded.tobytes())
        rows.append((subject_name, sample.sample_name, sample.class_id, CLASS_NAMES[sample.class_id], index,
                     round(index / config.fps, 4), crop_path.as_posix(), DETECTOR, *(round(v, 2) for v in box),
                     *(round(float(v), 2) for v in landmarks.reshape(-1)),
                     *(round(float(v), 6) for v in matrix.reshape(-1))))
    table = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
    atomic_write_csv(video_table_path(out_dir, {"subject_name": subject_name, "sample_name": sample.sample_name}),
                     table)
    return table


def _init_worker() -> None:
    cv2.setNumThreads(1)


def write_truth_crops(config: SyntheticConfig, preprocess: PreprocessConfig, out_dir: Path, source: str,
                      classes: tuple[str, ...] | None = None, workers: int | None = None,
                      progress: bool = True) -> tuple[PreprocessResult, pd.DataFrame]:
    """Every video's truth crops (or those of `classes` only) into `out_dir`, resumable as `make data` is; returns the
    result and the samples table (BioVid's columns). `source` identifies the twin (`check_config` refuses crops of
    another twin in the same folder)."""
    if preprocess.detector != DETECTOR:
        raise ValueError(f"truth crops record detector {DETECTOR!r}, got preprocess.detector={preprocess.detector!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_config(out_dir, preprocess, source)
    subjects = make_subjects(config)
    by_id = {subject.subject_id: subject for subject in subjects}
    samples = [s for s in make_samples(config, subjects) if classes is None or CLASS_NAMES[s.class_id] in classes]
    tables, jobs = [], []
    for sample in samples:
        name = by_id[sample.subject_id].subject_name
        done = video_table_path(out_dir, {"subject_name": name, "sample_name": sample.sample_name})
        if done.is_file():
            tables.append(pd.read_csv(done))
        else:
            jobs.append((config, by_id[sample.subject_id], sample, name, preprocess, out_dir))
    n_resumed = len(tables)
    workers = min(workers or available_cpus(), max(1, len(jobs)))
    with tqdm(total=len(jobs), desc="truth crops", unit="video", disable=not progress or not jobs) as bar:
        if workers == 1:
            for job in jobs:
                tables.append(crop_sample(job))
                bar.update()
        else:
            with process_pool(workers, _init_worker) as pool:
                for table in pool.imap_unordered(crop_sample, jobs):
                    tables.append(table)
                    bar.update()
    frames = pd.concat(tables, ignore_index=True).sort_values(["subject_name", "sample_name", "frame_index"],
                                                              ignore_index=True)
    failures = pd.DataFrame(columns=["subject_name", "sample_name", "class_name", "video_path", "reason"])
    frames_csv, failures_csv = out_dir / "frames.csv", out_dir / "failures.csv"
    atomic_write_csv(frames_csv, frames)
    atomic_write_csv(failures_csv, failures)
    table = pd.DataFrame([(s.subject_id, by_id[s.subject_id].subject_name, s.class_id, CLASS_NAMES[s.class_id],
                           s.sample_id, s.sample_name) for s in samples],
                         columns=["subject_id", "subject_name", "class_id", "class_name", "sample_id", "sample_name"])
    return PreprocessResult(frames, failures, len(jobs), n_resumed, frames_csv, failures_csv), table


def truth_preprocess(preprocess: PreprocessConfig) -> PreprocessConfig:
    """The crop settings of truth crops: the configured ones, with the detector named `truth`."""
    return dataclasses.replace(preprocess, detector=DETECTOR)

