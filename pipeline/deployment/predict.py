"""`make predict VIDEO=...`: the pain timeline of any video with a trained model.

The model is the registered champion (`models:/pain-<model>-<task>@champion`) unless `MODEL_URI=` names another
MLflow model or `RUN=` a fold or final run (the MLflow model that run logged, deciding at that run's threshold).
Frames are sampled at `predict.fps` per second (0: every frame), the same person is followed through them
(`pipeline.models.scoring`), and each scored frame gets a pain probability; the video's score aggregates its frames
as the cross-validation did (`trainer.aggregation`). Per video: a CSV (time_s, frame, face_found, pain_probability,
pain) and a PNG timeline (probability over time, the threshold, the video's decision, spans without a face shaded).
`VIDEO=` a folder scores every video in it and writes one summary row per video besides. A video without any face
gets a message and an empty timeline, never a score.
`VIDEO=` a folder's summary gives each video's status (scored / no face / failed); a damaged video says how many
frames were lost.

Exit status: 0 when at least one video was scored; 1 when none was and a video (the only one, or every one of the
folder that had no face) could not be read; 3 when every video was read but none showed a face.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import DictConfig

from pipeline.data.video import DEFAULT_FPS
from pipeline.models.scoring import FrameScorer
from pipeline.runs import tracking
from pipeline.utils.accelerator import announce_device
from pipeline.utils.atomic_io import atomic_write_csv, save_png
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v")
CHUNK = 32  # frames decoded and scored at a time: a long video never sits in memory whole


class PredictError(RuntimeError):
    """No model to use, or no video to score: the message says what to do."""


class PredictFailed(SystemExit):
    """Predict ran but scored no video: exit status 1 (every video, or the only one, could not be read) or 3 (read,
    but no face in any). `summary` is the table it wrote (one row per video)."""

    def __init__(self, status: int, summary: pd.DataFrame) -> None:
        super().__init__(status)
        self.summary = summary


@dataclass
class DecodeReport:
    """How much of a video could be read: frames the container announces, frames decoded, sampled frames lost."""

    announced: int = 0  # the container's frame count (0: it does not say)
    decoded: int = 0  # frames read from the stream, sampled or not
    sampled_lost: int = 0  # sampled frames whose picture could not be decoded

    @property
    def lost(self) -> int:
        """Frames the container announces that could not be decoded (a truncated or damaged file)."""
        return max(self.announced - self.decoded, 0) + self.sampled_lost


@dataclass
class VideoResult:
    video: Path
    frames: pd.DataFrame  # time_s, frame, face_found, pain_probability, pain
    score: float  # NaN without a face
    threshold: float
    seconds: float
    decoding: DecodeReport = field(default_factory=DecodeReport)

    @property
    def decision(self) -> str:
        if not np.isfinite(self.score):
            return "no face"
        return "pain" if self.score >= self.threshold else "no pain"


def sampled_frames(path: Path, fps: float, chunk: int = CHUNK,
                   report: DecodeReport | None = None) -> Iterator[tuple[list[int], list[float], list]]:
    """The video's frames at `fps` per second (0: all), decoded in order, in chunks of (indices, times, frames).
    `report`, if given, is filled with how many frames were announced, decoded and lost."""
    report = report if report is not None else DecodeReport()
    capture = cv2.VideoCapture(str(path))
    if not capture.isOpened():
        capture.release()
        raise PredictError(f"cannot open video {path} (empty, truncated or not a video)")
    native = capture.get(cv2.CAP_PROP_FPS) or DEFAULT_FPS
    report.announced = max(int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0), 0)
    step = native / fps if fps and fps > 0 else 1.0
    indices: list[int] = []
    times: list[float] = []
    frames: list = []
    index, taken, kept = 0, 0, 0
    try:
        while capture.grab():
            if index >= round(taken * step):
                ok, frame = capture.retrieve()
                if ok:
                    indices.append(index)
                    times.append(round(index / native, 4))
                    frames.append(frame)
                    kept += 1
                else:
                    report.sampled_lost += 1
                while round(taken * step) <= index:
                    taken += 1
                if len(frames) == chunk:
                    yield indices, times, frames
                    indices, times, frames = [], [], []
            index += 1
    finally:
        report.decoded = index
        capture.release()
    if frames:
        yield indices, times, frames
    if kept == 0:
        raise PredictError(f"{path}: no frame could be decoded")


def score_video(scorer: FrameScorer, path: Path, fps: float) -> VideoResult:
    started = time.perf_counter()
    follower = scorer.follower()
    parts = []
    decoding = DecodeReport()
    for indices, times, frames in sampled_frames(path, fps, report=decoding):
        table = scorer.score(frames, follower)
        table["frame"] = indices
        table.insert(0, "time_s", times)
        parts.append(table)
    frames = pd.concat(parts, ignore_index=True)
    score = scorer.video_score(frames)
    return VideoResult(path, frames, score, scorer.threshold, time.perf_counter() - started, decoding)


def plot_timeline(result: VideoResult, path: Path, title: str) -> None:
    """Probability over time, the threshold, faceless spans shaded, the decision in the title."""
    figure = Figure(figsize=(9, 3.2))
    axes = figure.add_subplot()
    table = result.frames
    times = table["time_s"].to_numpy()
    end = float(times[-1]) if len(times) else 1.0
    spacing = float(np.median(np.diff(times))) if len(times) > 1 else 0.2
    for t, found in zip(times, table["face_found"], strict=True):
        if not found:
            axes.axvspan(t - spacing / 2, t + spacing / 2, color="0.85", lw=0)
    if table["face_found"].any():
        axes.plot(times, table["pain_probability"], marker=".", lw=1.2, color="tab:red", label="pain probability")
    else:
        axes.text(end / 2, 0.5, "no face found: no score", ha="center", va="center", fontsize=12)
    axes.axhline(result.threshold, color="0.3", ls="--", lw=1, label=f"threshold {result.threshold:.2f}")
    axes.set_xlim(-spacing / 2, end + spacing / 2)
    axes.set_ylim(0, 1)
    axes.set_xlabel("time (s)")
    axes.set_ylabel("pain probability")
    score = f"score {result.score:.2f}: " if np.isfinite(result.score) else ""
    axes.set_title(f"{title}\n{score}{result.decision} (grey: no face)", fontsize=10)
    axes.legend(loc="upper right", fontsize=8)
    save_png(figure, path)


def write_outputs(result: VideoResult, out_stem: Path) -> tuple[Path, Path]:
    csv_path, png_path = out_stem.with_suffix(".csv"), out_stem.with_suffix(".png")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(csv_path, result.frames[["time_s", "frame", "face_found", "pain_probability", "pain"]])
    plot_timeline(result, png_path, result.video.name)
    return csv_path, png_path


def load_scorer(cfg: DictConfig, model_uri: str | None = None, run: str | None = None) -> tuple[FrameScorer, str]:
    """The scorer of an MLflow model (`model_uri`, default the registered champion) or of the MLflow model a fold or
    final run logged (`run`), built by the one factory (`pipeline.runs.mlflow_model.load_scorer`) once the model folder
    is found to be the project's (a refusal names the reason); and its name. A fold run's model decides at the
    threshold its validation subjects chose, as in the cross-validation."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pipeline.runs import mlflow_model
    from pipeline.runs.model_trust import UntrustedModel
    from pipeline.runs.registry import champion_uri

    tracking_uri = tracking.store_uri(cfg.mlflow.tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    if run:
        uri = run_model_uri(MlflowClient(tracking_uri), run)
        name = f"run {run} ({uri})"
    else:
        uri = model_uri or champion_uri(cfg.model.name, cfg.task.name)
        name = uri
    try:
        scorer = mlflow_model.load_scorer(uri, device=cfg.predict.device,
                                          min_face_fraction=float(cfg.predict.min_face_fraction))
    except UntrustedModel as error:
        raise PredictError(f"refused model {uri}: {error}") from None
    except (MlflowException, OSError) as error:
        hint = ("" if model_uri or run else f" (run `make final MODEL={cfg.model.name}` and `make promote "
                f"MODEL={cfg.model.name} VERSION=<n>`, or give MODEL_URI= or RUN=)")
        raise PredictError(f"cannot load model {uri}: {getattr(error, 'message', error)}{hint}") from None
    return scorer, name


def run_model_uri(client, run_id: str) -> str:
    """The MLflow model a fold's or a final model's run logged, as a URI; an error naming the run otherwise."""
    from mlflow.exceptions import MlflowException

    from pipeline.runs.mlflow_model import logged_model_uri

    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        raise PredictError(f"RUN={run_id}: {error.message}") from None
    kind = run.data.tags.get(tracking.RUN_KIND_TAG)
    if kind not in (tracking.FOLD_RUN, tracking.FINAL_RUN):
        raise PredictError(f"run {run_id} is neither a fold's nor a final model's run ({tracking.RUN_KIND_TAG}={kind})")
    uri = logged_model_uri(client, run_id)
    if uri is None:
        raise PredictError(f"run {run_id} logged no MLflow model (a fold keeps one with cv.log_models=true)")
    return uri


def videos_in(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file())
        if not found:
            raise PredictError(f"no video ({', '.join(VIDEO_SUFFIXES)}) in folder {path}")
        return found
    raise PredictError(f"VIDEO={path}: no such file or folder")


SCORED, NO_FACE, FAILED = "scored", "no face", "failed"  # a video's status in the summary


def predict(scorer: FrameScorer, video: Path, out_dir: Path, fps: float, model_name: str = "") -> pd.DataFrame:
    """Score one video or every video of a folder; CSV + PNG per video, and for a folder a summary CSV (one row per
    video, its status scored / no face / failed). Returns the summary; a video that cannot be read is a row with status
    failed and its reason, never an exception."""
    videos = videos_in(video)
    rows = []
    folder = video if video.is_dir() else None
    for path in videos:
        stem = out_dir / (path.relative_to(folder).with_suffix("") if folder else Path(path.stem))
        try:
            result = score_video(scorer, path, fps)
        except PredictError as error:
            print(f"{path}: failed ({error})", file=sys.stderr)
            rows.append({"video": str(path), "status": FAILED, "frames_scored": 0, "frames_with_face": 0,
                         "frames_lost": 0, "pain_score": np.nan, "decision": "", "error": str(error), "csv": "",
                         "png": ""})
            continue
        csv_path, png_path = write_outputs(result, stem)
        n_face = int(result.frames["face_found"].sum())
        lost = result.decoding.lost
        if lost:
            print(f"{path}: {lost} of {result.decoding.announced} frames could not be decoded (damaged or truncated "
                  f"file); scored what was read", file=sys.stderr)
        if n_face == 0:
            print(f"{path}: no face found in any of the {len(result.frames)} sampled frames: no score "
                  f"(timeline {png_path})")
        else:
            print(f"{path}: {result.decision} (score {result.score:.3f}, threshold {result.threshold:.3f}; face in "
                  f"{n_face} of {len(result.frames)} frames; {result.seconds:.1f} s) -> {csv_path}, {png_path}")
        rows.append({"video": str(path), "status": SCORED if n_face else NO_FACE, "frames_scored": len(result.frames),
                     "frames_with_face": n_face, "frames_lost": lost, "pain_score": result.score,
                     "decision": result.decision, "error": "", "csv": str(csv_path), "png": str(png_path)})
    summary = pd.DataFrame(rows)
    if folder is not None:
        summary_path = out_dir / "videos.csv"
        atomic_write_csv(summary_path, summary)
        print(f"{count_line(summary)} with {model_name}: {summary_path}")
    return summary


def count_line(summary: pd.DataFrame) -> str:
    """"3 videos: 1 scored, 1 without a face, 1 failed"."""
    counts = summary["status"].value_counts()
    return (f"{len(summary)} video{'s' if len(summary) != 1 else ''}: {counts.get(SCORED, 0)} scored, "
            f"{counts.get(NO_FACE, 0)} without a face, {counts.get(FAILED, 0)} failed")


def exit_status(summary: pd.DataFrame) -> int:
    """0: at least one video scored; 1: no video scored and at least one could not be read; 3: every video read,
    none with a face."""
    if (summary["status"] == SCORED).any():
        return 0
    return 1 if (summary["status"] == FAILED).any() else 3


def run_predict(cfg: DictConfig, video: str | None = None, model_uri: str | None = None, run: str | None = None,
                out: str | None = None) -> pd.DataFrame:
    """`make predict VIDEO=... [MODEL_URI=... | RUN=...] [FPS=5]`."""
    if not video:
        raise SystemExit("predict: say which video, e.g. make predict VIDEO=path/to/clip.mp4 (or a folder)")
    announce_device(cfg.predict.device)  # where the network and the detector run, said first
    started = time.perf_counter()
    video_path = Path(video).expanduser().resolve()
    out_dir = Path(out).expanduser().resolve() if out else resolve_path(cfg.reports_dir) / "predict"
    if video_path.is_dir() and not out:
        out_dir = out_dir / video_path.name
    try:
        videos_in(video_path)
        scorer, name = load_scorer(cfg, model_uri or None, run or None)
        print(f"model {name}: {scorer.meta['model_name']}, threshold {scorer.threshold:.3f} "
              f"(loaded in {time.perf_counter() - started:.1f} s)")
        summary = predict(scorer, video_path, out_dir, float(cfg.predict.fps), name)
    except PredictError as error:
        raise SystemExit(f"predict: {error}") from None
    per_frame = scorer.timings.per_frame()
    print(f"per frame: detection {per_frame['detect_s'] * 1000:.0f} ms, alignment {per_frame['align_s'] * 1000:.0f}"
          f" ms, network {per_frame['network_s'] * 1000:.0f} ms; total {time.perf_counter() - started:.1f} s")
    status = exit_status(summary)
    if status:  # nothing scored: a script must see it (a folder's other videos keep their timelines)
        print(f"predict: no video scored ({count_line(summary)})", file=sys.stderr)
        raise PredictFailed(status, summary)
    return summary
