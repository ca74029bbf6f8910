"""Video to face crops: sample frames from a window of each clip, find the face, crop it square, write JPEGs.

Parallel over videos, resumable (a video whose frame rows exist is skipped), atomic (every file appears whole or not
at all), and honest: every video that yields no crops is listed in `failures.csv` with the reason.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import pandas as pd
from tqdm import tqdm

from pipeline.faces import FaceDetector, build_detector, smooth_track, square_crop
from pipeline.io import atomic_write_bytes, atomic_write_csv, atomic_write_text
from pipeline.parallel import available_cpus, process_pool
from pipeline.video import VideoFailure, read_sampled_frames

log = logging.getLogger(__name__)

FRAME_COLUMNS = ("subject_name", "sample_name", "class_id", "class_name", "frame_index", "time_s", "crop_path",
                 "detection")
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
    smoothing: float

    def __post_init__(self) -> None:
        if self.frames_per_video < 1:
            raise ValueError(f"frames_per_video must be >= 1, got {self.frames_per_video}")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")


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
    track = smooth_track([detector.detect(frame) for frame in frames], alpha=config.smoothing)
    if track is None:
        raise VideoFailure(f"no face detected in any of the {len(frames)} sampled frames")
    boxes, statuses = track
    rows = []
    relative_dir = Path("crops") / sample["subject_name"] / sample["sample_name"]
    for index, frame, box, status in zip(indices, frames, boxes, statuses, strict=True):
        crop = square_crop(frame, box, margin=config.margin, size=config.crop_size)
        ok, encoded = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, config.jpeg_quality])
        if not ok:
            raise VideoFailure(f"JPEG encoding failed for frame {index}")
        crop_path = relative_dir / f"f{index:03d}.jpg"
        atomic_write_bytes(out_dir / crop_path, encoded.tobytes())
        rows.append((sample["subject_name"], sample["sample_name"], sample["class_id"], sample["class_name"],
                     int(index), round(index / fps, 4), crop_path.as_posix(), status))
    table = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
    atomic_write_csv(video_table_path(out_dir, sample), table)
    return table


def video_table_path(out_dir: Path, sample: dict) -> Path:
    return out_dir / "videos" / sample["subject_name"] / f"{sample['sample_name']}.csv"


_worker_state: dict = {}


def _init_worker(out_dir: Path, config: PreprocessConfig) -> None:
    cv2.setNumThreads(1)  # one process per core already; OpenCV's own threads would oversubscribe
    _worker_state.update(out_dir=out_dir, config=config, detector=build_detector(config.detector))


def _work(sample: dict) -> tuple[dict, pd.DataFrame | None, str | None]:
    try:
        return sample, crop_video(sample, _worker_state["out_dir"], _worker_state["config"],
                                  _worker_state["detector"]), None
    except VideoFailure as failure:
        return sample, None, str(failure)
    except cv2.error as error:  # a corrupt stream can make OpenCV raise mid-decode
        return sample, None, f"unreadable: OpenCV error {error}"


def check_config(out_dir: Path, config: PreprocessConfig) -> None:
    """Refuse to mix crops made with different settings in one folder; record the settings otherwise."""
    stored = out_dir / "preprocess.json"
    wanted = asdict(config)
    if stored.is_file():
        found = json.loads(stored.read_text())
        if found != wanted:
            changed = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
            raise ValueError(f"{out_dir} holds crops made with other settings ({', '.join(changed)} differ from "
                             f"{stored}); delete that folder or choose another processed_dir")
    else:
        atomic_write_text(stored, json.dumps(wanted, indent=2) + "\n")


def _run(samples: list[dict], out_dir: Path, config: PreprocessConfig, workers: int) -> Iterator[tuple]:
    if workers <= 1:
        _init_worker(out_dir, config)
        yield from map(_work, samples)
        return
    with process_pool(workers, _init_worker, (out_dir, config)) as pool:
        yield from pool.imap_unordered(_work, samples, chunksize=1)


def preprocess(samples: pd.DataFrame, out_dir: str | Path, config: PreprocessConfig,
               workers: int | None = None, progress: bool = True) -> PreprocessResult:
    """Crop every video of the sample table into `out_dir`; see the module docstring for the guarantees."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_config(out_dir, config)
    records = samples.to_dict("records")
    tables, todo = [], []
    for sample in records:
        done = video_table_path(out_dir, sample)
        if done.is_file():
            tables.append(pd.read_csv(done))
        else:
            todo.append(sample)
    n_resumed = len(tables)
    workers = workers or available_cpus()
    failures = []
    results = _run(todo, out_dir, config, min(workers, max(1, len(todo))))
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
    frames_csv, failures_csv = out_dir / "frames.csv", out_dir / "failures.csv"
    atomic_write_csv(frames_csv, frames)
    atomic_write_csv(failures_csv, failures_table)
    result = PreprocessResult(frames, failures_table, len(todo) - len(failures), n_resumed, frames_csv, failures_csv)
    for failure in failures[:20]:
        log.warning("failed: %s (%s)", failure["video_path"], failure["reason"])
    if len(failures) > 20:
        log.warning("... and %d more failed videos, see %s", len(failures) - 20, failures_csv)
    return result
