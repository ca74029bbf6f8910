"""Video to face crops: sample frames from a window of each clip, find the face (in one batch per video), crop it
square or aligned on its landmarks, write JPEGs.

Parallel over videos, resumable (a video whose frame rows exist is skipped), atomic (every file appears whole or not
at all), and honest: every video that yields no crops is listed in `failures.csv` with the reason.

Each frame row records where its crop came from: the face box, the five landmarks (when the detector gives them) and
the 2 x 3 affine matrix `crop_m00 .. crop_m12` that maps a video pixel (x, y) to the crop pixel (u, v)
(`video_to_crop`), so a region located in the video can be found in the crop.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from tqdm import tqdm

from pipeline.data.crop_geometry import aligned_crop, apply_transform, square_crop, square_crop_transform
from pipeline.data.face_tracks import smooth_faces
from pipeline.data.faces import LANDMARK_NAMES, FaceDetector, build_detector, find_faces, gives_landmarks
from pipeline.data.video import VideoFailure, read_sampled_frames
from pipeline.utils.atomic_io import SettingsMismatch, atomic_paths, atomic_write_csv, atomic_write_text
from pipeline.utils.cpus import available_cpus, process_pool

log = logging.getLogger(__name__)

BOX_COLUMNS = ("box_x", "box_y", "box_w", "box_h")  # the (smoothed) face box the crop was made from, video pixels
LANDMARK_COLUMNS = tuple(f"{name}_{axis}" for name in LANDMARK_NAMES for axis in "xy")  # empty for a box-only detector
TRANSFORM_COLUMNS = ("crop_m00", "crop_m01", "crop_m02", "crop_m10", "crop_m11", "crop_m12")  # video -> crop pixel
FRAME_COLUMNS = ("subject_name", "sample_name", "class_id", "class_name", "frame_index", "time_s", "crop_path",
                 "detection", *BOX_COLUMNS, *LANDMARK_COLUMNS, *TRANSFORM_COLUMNS)
# Settings added after crops were first made, with the value that earlier crops were made with: a folder whose
# preprocess.json predates a setting is still resumed when the setting keeps that value.
SETTINGS_BEFORE_RECORDED = {"align": False}
FAILURE_COLUMNS = ("subject_name", "sample_name", "class_name", "video_path", "reason")


@dataclass(frozen=True)
class PreprocessConfig:
    """How crops are made; stored as preprocess.json so a folder never mixes crops made two ways.

    No defaults here: the values live once, in configs/config.yaml (preprocess).
    """

    start_s: float  # the facial response lags the heat onset: skip the start of the clip
    end_s: float | None  # None = to the end of the clip
    frames_per_video: int
    crop_size: int
    margin: float
    jpeg_quality: int
    detector: str
    smoothing: float  # weight of each new detection in the smoothed box and landmarks (1 = no smoothing)
    align: bool  # crops aligned on the five landmarks (needs a detector that gives them) instead of square boxes

    def __post_init__(self) -> None:
        if self.frames_per_video < 1:
            raise ValueError(f"frames_per_video must be >= 1, got {self.frames_per_video}")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
        if self.align and not gives_landmarks(self.detector):
            raise ValueError(f"align needs landmarks, and the {self.detector!r} face detector gives only a box: "
                             f"use preprocess.detector=mtcnn, or preprocess.align=false")


@dataclass
class PreprocessResult:
    frames: pd.DataFrame
    failures: pd.DataFrame
    n_processed: int  # videos cropped in this run
    n_resumed: int  # videos already done by an earlier run
    frames_csv: Path
    failures_csv: Path

    def summary(self) -> str:
        n_videos = self.frames.sample_name.nunique() if len(self.frames) else 0
        detected = (self.frames.detection == "detected").mean() if len(self.frames) else float("nan")
        return (f"{n_videos} videos -> {len(self.frames)} crops ({self.n_processed} processed now, "
                f"{self.n_resumed} resumed); face detected in {detected:.1%} of sampled frames; "
                f"{len(self.failures)} failed video(s) listed in {self.failures_csv}")


def crop_video(sample: dict, out_dir: Path, config: PreprocessConfig, detector: FaceDetector) -> pd.DataFrame:
    """Crop one video's sampled frames; returns its frame rows (written last, as the video's 'done' marker)."""
    indices, frames, fps = read_sampled_frames(sample["video_path"], config.frames_per_video, config.start_s,
                                               config.end_s)
    track = smooth_faces(find_faces(detector, frames), alpha=config.smoothing)
    if track is None:
        raise VideoFailure(f"no face detected in any of the {len(frames)} sampled frames")
    faces, statuses = track
    rows, encoded_crops = [], []
    relative_dir = Path("crops") / sample["subject_name"] / sample["sample_name"]
    for index, frame, face, status in zip(indices, frames, faces, statuses, strict=True):
        if config.align:
            try:
                crop, matrix = aligned_crop(frame, face.landmarks, margin=config.margin, size=config.crop_size)
            except ValueError as error:  # landmarks that define no transform (all in one point)
                raise VideoFailure(f"cannot align frame {index}: {error}") from error
        else:
            crop = square_crop(frame, face.box, margin=config.margin, size=config.crop_size)
            matrix = square_crop_transform(face.box, margin=config.margin, size=config.crop_size)
        ok, encoded = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, config.jpeg_quality])
        if not ok:
            raise VideoFailure(f"JPEG encoding failed for frame {index}")
        crop_path = relative_dir / f"f{index:03d}.jpg"
        encoded_crops.append((out_dir / crop_path, encoded.tobytes()))
        landmarks = [np.nan] * len(LANDMARK_COLUMNS) if face.landmarks is None else face.landmarks.reshape(-1)
        rows.append((sample["subject_name"], sample["sample_name"], sample["class_id"], sample["class_name"],
                     int(index), round(index / fps, 4), crop_path.as_posix(), status,
                     *(round(float(v), 2) for v in face.box), *(round(float(v), 2) for v in landmarks),
                     *(round(float(v), 6) for v in matrix.reshape(-1))))
    with atomic_paths([path for path, _ in encoded_crops]) as temporaries:  # one flush for all, not 2 fsyncs each
        for temporary, (_, data) in zip(temporaries, encoded_crops, strict=True):
            temporary.write_bytes(data)
    table = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
    atomic_write_csv(video_table_path(out_dir, sample), table)  # last: the video's crops are all on the disk
    return table


def video_table_path(out_dir: Path, sample: dict) -> Path:
    return out_dir / "videos" / sample["subject_name"] / f"{sample['sample_name']}.csv"


def crop_transform(row: pd.Series | dict) -> np.ndarray:
    """A frame row's 2 x 3 matrix mapping video pixels to crop pixels (NaN for rows made before it was recorded)."""
    return np.array([float(row[column]) for column in TRANSFORM_COLUMNS]).reshape(2, 3)


def video_to_crop(row: pd.Series | dict, points: np.ndarray) -> np.ndarray:
    """Points (n, 2) in the video's pixels mapped to the crop of a frame row (its `crop_m..` columns)."""
    return apply_transform(crop_transform(row), points)


_worker_state: dict = {}


def _init_worker(out_dir: Path, config: PreprocessConfig, device: str = "auto", pooled: bool = True) -> None:
    cv2.setNumThreads(1)  # one process per core already; OpenCV's own threads would oversubscribe
    if pooled:
        import torch

        torch.set_num_threads(1)  # likewise for a detector's network
    options = {"device": device} if "device" in _detector_options(config.detector) else {}
    _worker_state.update(out_dir=out_dir, config=config, detector=build_detector(config.detector, **options))


def _detector_options(name: str) -> set[str]:
    import inspect

    from pipeline.data.faces import DETECTORS

    try:
        return set(inspect.signature(DETECTORS[name]).parameters)
    except (TypeError, ValueError):
        return set()


def _work(sample: dict) -> tuple[dict, pd.DataFrame | None, str | None]:
    try:
        return sample, crop_video(sample, _worker_state["out_dir"], _worker_state["config"],
                                  _worker_state["detector"]), None
    except VideoFailure as failure:
        return sample, None, str(failure)
    except cv2.error as error:  # a corrupt stream can make OpenCV raise mid-decode
        return sample, None, f"unreadable: OpenCV error {error}"


def check_config(out_dir: Path, config: PreprocessConfig, source: str | None = None) -> None:
    """Refuse to mix crops made with different settings, or from a different source, in one folder; record the
    settings otherwise.

    `source` identifies the videos (the synthetic twin passes a hash of its generator config): crops of a twin
    generated with other settings are refused too, instead of being resumed as if they were the new twin's.
    """
    stored = out_dir / "preprocess.json"
    wanted = asdict(config) | ({"source": source} if source is not None else {})
    if stored.is_file():
        found = SETTINGS_BEFORE_RECORDED | json.loads(stored.read_text())
        adopt = source is not None and "source" not in found  # written before sources were recorded: take this one
        if adopt:
            found["source"] = source
        if found != wanted:
            changed = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
            hint = (" (the videos were generated with other settings)" if changed == ["source"] else "")
            raise SettingsMismatch(f"{out_dir} holds crops made with other settings{hint} ({', '.join(changed)} differ "
                             f"from {stored}); delete that folder or choose another processed_dir")
        if adopt:
            atomic_write_text(stored, json.dumps(found, indent=2) + "\n")
    else:
        atomic_write_text(stored, json.dumps(wanted, indent=2) + "\n")


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """One worker is one core, in this process too (the per-core throughput `make bench-data` reports)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(samples: list[dict], out_dir: Path, config: PreprocessConfig, workers: int,
         device: str) -> Iterator[tuple]:
    if workers <= 1:
        with _one_torch_thread():
            _init_worker(out_dir, config, device, pooled=False)
            yield from map(_work, samples)
        return
    with process_pool(workers, _init_worker, (out_dir, config, device)) as pool:
        yield from pool.imap_unordered(_work, samples, chunksize=1)


def current_tables(records: list[dict], frames_csv: Path, failures_csv: Path,
                   newest: int) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The frame and failure tables on disk where they already are what gathering every video's table would write:
    written after the newest of those tables, no failure listed, and the frame table's videos exactly `records`'.
    None otherwise (they are gathered and written again). Reading one table instead of one per video: a
    cross-validation's start on 8,700 videos takes a second, not ten."""
    try:
        if frames_csv.stat().st_mtime_ns < newest or not failures_csv.is_file():
            return None
    except FileNotFoundError:
        return None
    try:
        failures = pd.read_csv(failures_csv, dtype=str, keep_default_na=False)
        frames = pd.read_csv(frames_csv) if not len(failures) else None
    except pd.errors.EmptyDataError:  # not a table this module wrote
        return None
    if frames is None:
        return None
    wanted = {(str(r["subject_name"]), str(r["sample_name"])) for r in records}
    found = set(zip(frames["subject_name"].astype(str), frames["sample_name"].astype(str), strict=True))
    return (frames, failures) if found == wanted else None


def preprocess(samples: pd.DataFrame, out_dir: str | Path, config: PreprocessConfig,
               workers: int | None = None, progress: bool = True, device: str = "auto",
               source: str | None = None) -> PreprocessResult:
    """Crop every video of the sample table into `out_dir`; see the module docstring for the guarantees.

    `device` is where a network detector runs ("auto": the GPU when there is one); `source` identifies the videos
    (see `check_config`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_config(out_dir, config, source)
    records = samples.to_dict("records")
    done, todo, newest = [], [], 0
    for sample in records:
        path = video_table_path(out_dir, sample)
        try:
            newest = max(newest, path.stat().st_mtime_ns)
            done.append(path)
        except FileNotFoundError:
            todo.append(sample)
    frames_csv, failures_csv = out_dir / "frames.csv", out_dir / "failures.csv"
    if not todo:
        current = current_tables(records, frames_csv, failures_csv, newest)
        if current is not None:
            return PreprocessResult(*current, 0, len(done), frames_csv, failures_csv)
    tables = [pd.read_csv(path) for path in done]
    n_resumed = len(tables)
    workers = workers or available_cpus()
    failures = []
    results = _run(todo, out_dir, config, min(workers, max(1, len(todo))), device)
    for sample, table, reason in tqdm(results, total=len(todo), desc="face crops", unit="video",
                                      disable=not progress or not todo):
        if reason is None:
            tables.append(table)
        else:
            failures.append({**{k: sample[k] for k in FAILURE_COLUMNS if k != "reason"}, "reason": reason})

    frames = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=list(FRAME_COLUMNS))
    frames = frames.sort_values(["subject_name", "sample_name", "frame_index"], ignore_index=True)
    failures_table = pd.DataFrame(failures, columns=list(FAILURE_COLUMNS)).sort_values(
        ["subject_name", "sample_name"], ignore_index=True)
    atomic_write_csv(frames_csv, frames)
    atomic_write_csv(failures_csv, failures_table)
    result = PreprocessResult(frames, failures_table, len(todo) - len(failures), n_resumed, frames_csv, failures_csv)
    for failure in failures[:20]:
        log.warning("failed: %s (%s)", failure["video_path"], failure["reason"])
    if len(failures) > 20:
        log.warning("... and %d more failed videos, see %s", len(failures) - 20, failures_csv)
    return result
