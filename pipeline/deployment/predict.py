"""`make predict VIDEO=...`: the pain timeline of any video with a trained model.

The model is the registered champion (`models:/pain-<model>-<task>@champion`) unless `MODEL_URI=` names another
MLflow model or `RUN=` a fold or final run (the MLflow model that run logged, deciding at that run's threshold).
Frames are sampled at `predict.fps` per second (0: every frame), the same person is followed through them
(`pipeline.models.scoring`), and each scored frame gets a pain probability; the video's score aggregates its frames
as the cross-validation did (`trainer.aggregation`). Per video: a CSV (time_s, frame, face_found, pain_probability,
pain) and a PNG timeline (probability over time, the threshold, the video's decision, spans without a face shaded),
named by the video's whole file name (`clip.v1.mp4` -> `clip.v1.mp4.csv`, `.png`; in a folder, its path inside the
folder), so no two videos share an output. A video without any face gets a message and an empty timeline, never a
score.
A personalised model (`personalise=`) scores against the person's own recordings, `REFERENCE=<folder>`
(`pipeline.deployment.reference`); every video of one call is taken to be that person's.
`VIDEO=` a folder scores every video in it, subfolders included, and writes `videos.csv` (a name no video's output
has), one row per video with its status (scored / no face / failed) and, for a failure, a one-line reason: whatever
one video raises is its row, never the end of the folder. A folder that cannot be listed (or a link to a folder,
not followed) is a row of its own (status `folder not read`), counted and said on stderr; a damaged video says how
many frames were lost. Every file is written atomically.

Exit status (`exit_status`): 0 when at least one video was scored and none failed (faceless videos are results);
4 when some were scored and others failed or a folder was not read; 1 when none was scored and something failed
(also for a missing model or path); 3 when every video was read but none showed a face.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import DictConfig

from pipeline.deployment.reference import attach_reference
from pipeline.deployment.video_frames import (
    VIDEO_SUFFIXES,
    DecodeReport,
    PredictError,
    printable,
    sampled_frames,
    shown,
)
from pipeline.models.scoring import FrameScorer
from pipeline.runs.serving import mlflow_model
from pipeline.runs.serving.model_trust import UntrustedModel
from pipeline.runs.store import tracking
from pipeline.runs.store.registry import champion_uri
from pipeline.utils.accelerator import announce_device
from pipeline.utils.atomic_io import atomic_write_csv, save_png
from pipeline.utils.config_checks import check_required
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)


class PredictFailed(SystemExit):
    """Predict ran but did not score everything it was given: exit status 4 (some videos scored, others failed or a
    folder was not read), 1 (none scored, something failed) or 3 (every video read, no face in any). `summary` is the
    table it wrote (one row per video, and per folder not read)."""

    def __init__(self, status: int, summary: pd.DataFrame) -> None:
        super().__init__(status)
        self.summary = summary


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


def one_line(error: BaseException) -> str:
    """The reason a video failed, on one line: the message of a PredictError (it says what happened), else the
    exception's type and message, whitespace runs (a traceback's or OpenCV's newlines) made single spaces."""
    text = str(error) if isinstance(error, PredictError) else f"{type(error).__name__}: {error}"
    return " ".join(printable(text).split())


def score_video(scorer: FrameScorer, path: Path, fps: float) -> VideoResult:
    started = time.perf_counter()
    follower = scorer.follower()
    parts = []
    decoding = DecodeReport()
    for indices, times, frames in sampled_frames(path, fps, report=decoding):
        table = scorer.score(frames, follower, times)
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


def output_paths(stem: Path) -> tuple[Path, Path]:
    """A video's CSV and PNG: its output stem (the video's whole name, extension included) + .csv and .png."""
    return stem.with_name(f"{stem.name}.csv"), stem.with_name(f"{stem.name}.png")


@dataclass(frozen=True)
class ScorerSource:
    """Where a command finds the model it scores with and how its scorer runs: the store, the backbone and task whose
    registered champion is the default, and the `predict` group's device and smallest face."""

    tracking_uri: str  # the store's URI, resolved (`tracking.store_uri`)
    model_name: str
    task: str
    device: str
    min_face_fraction: float

    @classmethod
    def of(cls, tracking_uri: str | None, model_name: str, task: str, predict: Mapping[str, Any]) -> ScorerSource:
        """From `mlflow.tracking_uri`, `model.name`, `task.name` and the `predict` group."""
        return cls(tracking.store_uri(tracking_uri), str(model_name), str(task), str(predict["device"]),
                   float(predict["min_face_fraction"]))


def find_scorer(source: ScorerSource, model_uri: str | None = None,
                run: str | None = None) -> tuple[FrameScorer, str]:
    """The scorer of an MLflow model (`model_uri`, default the registered champion) or of the MLflow model a fold or
    final run logged (`run`), built by the one factory (`pipeline.runs.serving.mlflow_model.load_scorer`) once the model
    folder is found to be the project's (a refusal names the reason); and its name. A fold run's model decides at the
    threshold its validation subjects chose, as in the cross-validation."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException


    tracking_uri = source.tracking_uri
    mlflow.set_tracking_uri(tracking_uri)
    if run:
        uri = run_model_uri(MlflowClient(tracking_uri), run)
        name = f"run {run} ({uri})"
    else:
        uri = model_uri or champion_uri(source.model_name, source.task)
        name = uri
    try:
        scorer = mlflow_model.load_scorer(uri, device=source.device, min_face_fraction=source.min_face_fraction)
    except UntrustedModel as error:
        raise PredictError(f"refused model {uri}: {error}") from None
    except (MlflowException, OSError) as error:
        hint = ("" if model_uri or run else f" (run `make final MODEL={source.model_name}` and `make promote "
                f"MODEL={source.model_name} VERSION=<n>`, or give MODEL_URI= or RUN=)")
        raise PredictError(f"cannot load model {uri}: {getattr(error, 'message', error)}{hint}") from None
    return scorer, name


def run_model_uri(client, run_id: str) -> str:
    """The MLflow model a fold's or a final model's run logged, as a URI; an error naming the run otherwise."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        raise PredictError(f"RUN={run_id}: {error.message}") from None
    kind = run.data.tags.get(tracking.RUN_KIND_TAG)
    if kind not in (tracking.FOLD_RUN, tracking.FINAL_RUN):
        raise PredictError(f"run {run_id} is neither a fold's nor a final model's run ({tracking.RUN_KIND_TAG}={kind})")
    uri = mlflow_model.logged_model_uri(client, run_id)
    if uri is None:
        raise PredictError(f"run {run_id} logged no MLflow model (a fold keeps one with cv.log_models=true)")
    return uri


SUMMARY_NAME = "videos.csv"  # a folder's summary: a video's outputs end in its own suffix + .csv / .png, never so
SCORED, NO_FACE, FAILED = "scored", "no face", "failed"  # a video's status in the summary
NOT_READ = "folder not read"  # a summary row for a folder that could not be listed, or a link to one (not followed)
SUMMARY_COLUMNS = ("video", "status", "frames_scored", "frames_with_face", "frames_lost", "pain_score", "decision",
                   "error", "csv", "png")


@dataclass
class Inputs:
    """What VIDEO= names: the videos to score, the folder they were found in (None for one file) and the folders
    inside it that were not searched, each with the reason."""

    videos: list[Path]
    folder: Path | None = None
    not_read: list[tuple[Path, str]] = field(default_factory=list)


def find_videos(path: Path) -> Inputs:
    """The file, or every video (`VIDEO_SUFFIXES`) under the folder, links to files included; a folder that cannot be
    listed and a link to a folder (not followed, as before) are kept with the reason, never skipped silently."""
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError as error:  # a file in a folder this process may not search
        raise PredictError(f"VIDEO={shown(path)}: {error.strerror or error}") from None
    if is_file:
        return Inputs([path])
    if not is_dir:
        raise PredictError(f"VIDEO={shown(path)}: no such file or folder")
    videos: list[Path] = []
    not_read: list[tuple[Path, str]] = []

    def unreadable(error: OSError) -> None:
        not_read.append((Path(error.filename or path), f"cannot list the folder: {error.strerror or error}"))

    for root, folders, files in os.walk(path, onerror=unreadable):
        not_read += [(Path(root, name), "a link to a folder: not followed (give VIDEO= its target)")
                     for name in folders if os.path.islink(os.path.join(root, name))]
        # every name with a video suffix: one that is no regular file, or a broken link, fails with the reason
        videos += [Path(root, name) for name in files if Path(name).suffix.lower() in VIDEO_SUFFIXES]
    if not videos and not not_read:
        raise PredictError(f"no video ({', '.join(VIDEO_SUFFIXES)}) in folder {shown(path)}")
    return Inputs(sorted(videos), path, sorted(not_read))


def output_stems(inputs: Inputs, out_dir: Path) -> tuple[dict[Path, Path], dict[Path, str]]:
    """Each video's output stem: out_dir / its path inside the folder, whole name (one file: its name), so two videos
    never share an output. A stem that would need a folder where another output or the summary is a file (a subfolder
    named `a.mp4.csv` beside `a.mp4`, or `videos.csv`) cannot be written: those videos come back with the reason."""
    if inputs.folder is None:
        return {video: out_dir / video.name for video in inputs.videos}, {}
    stems = {video: out_dir / video.relative_to(inputs.folder) for video in inputs.videos}
    owners = {out_dir / SUMMARY_NAME: "the folder's summary"}
    for video, stem in stems.items():
        owners.update(dict.fromkeys(output_paths(stem), shown(video)))
    clashes = {}
    for video, stem in stems.items():
        taken = [parent for parent in stem.parents if parent in owners]
        if taken:
            clashes[video] = (f"its outputs would go into the folder {shown(taken[0])}, which is an output file of "
                              f"{owners[taken[0]]}: rename the subfolder")
    return {video: stem for video, stem in stems.items() if video not in clashes}, clashes


def failed_row(video: Path, reason: str, status: str = FAILED, **written: str) -> dict:
    """A summary row of a video (or folder) with nothing scored, and why."""
    return {"video": shown(video), "status": status, "frames_scored": 0, "frames_with_face": 0, "frames_lost": 0,
            "pain_score": np.nan, "decision": "", "error": reason, "csv": written.get("csv", ""),
            "png": written.get("png", "")}


def predict_video(scorer: FrameScorer, path: Path, stem: Path, fps: float) -> dict:
    """Score one video and write its CSV and PNG; its summary row. Whatever it raises (a PredictError, OpenCV, the
    detector, the network, a write) is that video's failed row with a one-line reason, never an exception: one bad
    video does not end a folder (KeyboardInterrupt and SystemExit still do)."""
    csv_path, png_path = output_paths(stem)
    written: dict[str, str] = {}
    try:
        result = score_video(scorer, path, fps)
        atomic_write_csv(csv_path, result.frames[["time_s", "frame", "face_found", "pain_probability", "pain"]])
        written["csv"] = shown(csv_path)
        plot_timeline(result, png_path, shown(result.video.name))
        written["png"] = shown(png_path)
    except Exception as error:  # any error of one video is its row (see the docstring)
        reason = one_line(error)
        if not isinstance(error, PredictError):
            log.info("%s failed", shown(path), exc_info=error)  # its traceback, shown with VERBOSE=1
        print(f"{shown(path)}: failed ({reason})", file=sys.stderr)
        return failed_row(path, reason, **written)
    n_face = int(result.frames["face_found"].sum())
    lost = result.decoding.lost
    if lost:
        print(f"{shown(path)}: {lost} of {result.decoding.announced} frames could not be decoded (damaged or "
              f"truncated file); scored what was read", file=sys.stderr)
    if n_face == 0:
        print(f"{shown(path)}: no face found in any of the {len(result.frames)} sampled frames: no score "
              f"(timeline {shown(png_path)})")
    else:
        print(f"{shown(path)}: {result.decision} (score {result.score:.3f}, threshold {result.threshold:.3f}; face "
              f"in {n_face} of {len(result.frames)} frames; {result.seconds:.1f} s) -> {shown(csv_path)}, "
              f"{shown(png_path)}")
    return {"video": shown(path), "status": SCORED if n_face else NO_FACE, "frames_scored": len(result.frames),
            "frames_with_face": n_face, "frames_lost": lost, "pain_score": result.score,
            "decision": result.decision, "error": "", "csv": shown(csv_path), "png": shown(png_path)}


def predict(scorer: FrameScorer | None, inputs: Inputs, out_dir: Path, fps: float,
            model_name: str = "") -> pd.DataFrame:
    """Score the videos of `inputs`; CSV + PNG per video, and for a folder the summary `videos.csv` (one row per
    video, status scored / no face / failed, then one per folder not read). Returns the summary. `scorer` may be None
    only when there is no video to score (every folder unreadable)."""
    if inputs.videos and scorer is None:
        raise ValueError("predict needs a scorer when there are videos to score")
    stems, clashes = output_stems(inputs, out_dir)
    rows = []
    for path in inputs.videos:
        if path in clashes:
            print(f"{shown(path)}: failed ({clashes[path]})", file=sys.stderr)
            rows.append(failed_row(path, clashes[path]))
        elif scorer is not None:
            rows.append(predict_video(scorer, path, stems[path], fps))
    for folder, reason in inputs.not_read:
        print(f"{shown(folder)}: {NOT_READ} ({reason}): videos in it are not scored", file=sys.stderr)
        rows.append(failed_row(folder, reason, status=NOT_READ))
    summary = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    if inputs.folder is not None:
        summary_path = out_dir / SUMMARY_NAME
        atomic_write_csv(summary_path, summary)
        print(f"{count_line(summary)}{f' with {model_name}' if model_name else ''}: {shown(summary_path)}")
    return summary


def count_line(summary: pd.DataFrame) -> str:
    """"3 videos: 1 scored, 1 without a face, 1 failed", and "; 1 folder not read" when one was not."""
    counts = summary["status"].value_counts()
    n_videos = int((summary["status"] != NOT_READ).sum())
    n_folders = int(counts.get(NOT_READ, 0))
    folders = f"; {n_folders} folder{'s' if n_folders != 1 else ''} not read" if n_folders else ""
    return (f"{n_videos} video{'s' if n_videos != 1 else ''}: {counts.get(SCORED, 0)} scored, "
            f"{counts.get(NO_FACE, 0)} without a face, {counts.get(FAILED, 0)} failed{folders}")


def exit_status(summary: pd.DataFrame) -> int:
    """0: at least one video scored and none failed (a faceless video is a result, not a failure); 4: some scored,
    others failed or a folder was not read; 1: none scored and something failed; 3: every video read, none with a
    face."""
    scored = bool((summary["status"] == SCORED).any())
    missed = bool(summary["status"].isin([FAILED, NOT_READ]).any())
    if scored:
        return 4 if missed else 0
    return 1 if missed else 3


def run_predict(cfg: DictConfig, video: str | None = None, model_uri: str | None = None, run: str | None = None,
                out: str | None = None, reference: str | None = None) -> pd.DataFrame:
    """`make predict VIDEO=... [MODEL_URI=... | RUN=...] [FPS=5] [REFERENCE=<folder>]`: REFERENCE= is the person's
    own recordings, which a personalised model needs (`pipeline.deployment.reference`)."""
    check_required("predict", {"video": video})
    announce_device(cfg.predict.device)  # where the network and the detector run, said first
    started = time.perf_counter()
    video_path = Path(video).expanduser().resolve()
    out_dir = Path(out).expanduser().resolve() if out else resolve_path(cfg.reports_dir) / "predict"
    if video_path.is_dir() and not out:
        out_dir = out_dir / video_path.name
    try:
        inputs = find_videos(video_path)
        if not inputs.videos:  # every folder unreadable: the summary says which, no model needed
            summary = predict(None, inputs, out_dir, float(cfg.predict.fps))
        else:
            scorer, name = find_scorer(ScorerSource.of(cfg.mlflow.tracking_uri, cfg.model.name, cfg.task.name,
                                                       cfg.predict), model_uri or None, run or None)
            print(f"model {name}: {scorer.meta['model_name']}, threshold {scorer.threshold:.3f} "
                  f"(loaded in {time.perf_counter() - started:.1f} s)")
            said = attach_reference(scorer, reference or None, float(cfg.predict.fps))
            if said:
                print(said)
            summary = predict(scorer, inputs, out_dir, float(cfg.predict.fps), name)
            per_frame = scorer.timings.per_frame()
            print(f"per frame: detection {per_frame['detect_s'] * 1000:.0f} ms, alignment "
                  f"{per_frame['align_s'] * 1000:.0f} ms, network {per_frame['network_s'] * 1000:.0f} ms; total "
                  f"{time.perf_counter() - started:.1f} s")
    except PredictError as error:
        raise SystemExit(f"predict: {error}") from None
    status = exit_status(summary)
    if status:  # a script must see it (the videos that were scored keep their timelines)
        what = "not every video scored" if status == 4 else "no video scored"
        print(f"predict: {what} ({count_line(summary)})", file=sys.stderr)
        raise PredictFailed(status, summary)
    return summary
