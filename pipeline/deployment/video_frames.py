"""Reading a video for scoring: its frames at a chosen rate, decoded in chunks, with a report of what could not be
read, and the checks made before OpenCV is handed a file (`make predict`, and a personalised model's reference
recordings, `pipeline.deployment.reference`). Paths are printed with `shown`, whatever bytes their names hold."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2

from pipeline.data.video import DEFAULT_FPS

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v")
CHUNK = 32  # frames decoded and scored at a time: a long video never sits in memory whole


class PredictError(RuntimeError):
    """No model to use, or no video to score: the message says what to do."""



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



def sampled_frames(path: Path, fps: float, chunk: int = CHUNK,
                   report: DecodeReport | None = None) -> Iterator[tuple[list[int], list[float], list]]:
    """The video's frames at `fps` per second (0: all), decoded in order, in chunks of (indices, times, frames).
    `report`, if given, is filled with how many frames were announced, decoded and lost."""
    report = report if report is not None else DecodeReport()
    check_openable(path)
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


def check_openable(path: Path) -> None:
    """A PredictError naming the file when OpenCV cannot be handed it: a name that is not UTF-8 (OpenCV's Python
    binding crashes the process on one: seen with opencv-python 4.14), something other than a regular file (a FIFO
    would block the read), or a file this process may not read (OpenCV would say only that it cannot open it)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise PredictError(f"{shown(path)}: the file name is not valid UTF-8, which OpenCV cannot open: rename the "
                           "file") from None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise PredictError(f"{shown(path)} is not a regular file")
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as error:
        raise PredictError(f"cannot read {shown(path)}: {error.strerror or error}") from None


def printable(text: str) -> str:
    """Text that prints and writes under any locale: the bytes of a file name that are not UTF-8 (Python's
    surrogate escapes) appear as \\xNN, any other lone surrogate as \\uNNNN."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(path: Path | str) -> str:
    """A path as `printable` text."""
    return printable(str(path))
