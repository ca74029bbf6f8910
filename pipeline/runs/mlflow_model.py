"""The pain model as an MLflow Model: frames in, a pain probability and a decision per frame out.

It is logged as an MLflow "model from code" (`pipeline/runs/mlflow_model_code.py` is the code file MLflow stores with
the model; it only instantiates `PainMlflowModel`). What MLflow stores besides:

- artifact `weights`: the kept model file (`pipeline.models.model_file`: state dict, backbone, input size, mean/std,
  crop window and fraction, class names, weights provenance), read with `weights_only=True`;
- `model_config`: the decision threshold and the rule that chose it, the video aggregation, how the training crops
  were made (detector, alignment, margin, crop size, JPEG quality) and the smallest face searched for;
- `metadata`: where the weights come from (source CV run, final or fold run, git commit), shown in the MLmodel file.

Input: a DataFrame, one row per frame in time order, with column `image` (the frame as a base64-encoded PNG or JPEG)
or column `path` (an image file the scoring process can read). Output: a DataFrame with `frame` (the row's position),
`face_found`, `pain_probability` (1 - P(no pain); NaN without a face) and `pain` (probability >= threshold; null
without a face). The rows of one request are one sequence: the same person is followed through them.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import mlflow
import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from pipeline.models.scoring import CropSettings, FrameScorer
from pipeline.utils.paths import git_commit

CODE_FILE = Path(__file__).with_name("mlflow_model_code.py")
WEIGHTS_ARTIFACT = "weights"
# What the scoring process must have installed (the package itself brings the rest); pinned to what trained it.
REQUIREMENTS = ("torch", "torchvision", "timm", "transformers", "albumentations", "opencv-python-headless", "pandas",
                "numpy", "mtcnn", "joblib", "mlflow", "omegaconf")


def decode_image(value: str | bytes) -> np.ndarray:
    """A base64-encoded PNG/JPEG (str or bytes) -> BGR frame; an undecodable one is an error."""
    data = base64.b64decode(value) if isinstance(value, str) else bytes(value)
    frame = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if frame is None:
        raise ValueError("an 'image' value is not a base64-encoded PNG or JPEG")
    return frame


def encode_image(frame_bgr: np.ndarray, fmt: str = ".png") -> str:
    """A BGR frame as base64 text (PNG: lossless, so the server sees the very pixels `make predict` sees)."""
    ok, encoded = cv2.imencode(fmt, frame_bgr)
    if not ok:
        raise ValueError(f"cannot encode a frame of shape {frame_bgr.shape} as {fmt}")
    return base64.b64encode(encoded.tobytes()).decode("ascii")


def frames_from_input(model_input: pd.DataFrame | list | dict) -> list[np.ndarray]:
    """The request's frames in row order, from column `image` (base64) or `path` (readable image files)."""
    table = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
    frames = []
    for row, record in enumerate(table.to_dict("records")):
        image, path = record.get("image"), record.get("path")
        if isinstance(image, str | bytes) and len(image):
            try:
                frames.append(decode_image(image))
            except ValueError as error:
                raise ValueError(f"row {row}: {error}") from None
        elif isinstance(path, str) and path:
            frame = cv2.imread(path, cv2.IMREAD_COLOR)
            if frame is None:
                raise ValueError(f"row {row}: cannot read image file {path!r}")
            frames.append(frame)
        else:
            raise ValueError(f"row {row}: needs an 'image' (base64 PNG/JPEG) or a 'path' value")
    return frames


def scorer_from_config(weights_path: str | Path, config: dict[str, Any], device: str = "cpu",
                       ensemble_paths: Sequence[str | Path] = ()) -> FrameScorer:
    """A `FrameScorer` from a kept model file and the model's config (what `load_context` builds); more kept model
    files make a fold ensemble that averages their probabilities."""
    from pipeline.models.model_file import load_model_file

    net, meta = load_model_file(Path(weights_path))
    members = [load_model_file(Path(path))[0] for path in ensemble_paths]
    return FrameScorer(net, meta, CropSettings.from_dict(config.get("crop", {})),
                      threshold=float(config.get("threshold", 0.5)), aggregation=config.get("aggregation", "mean"),
                      topk=int(config.get("topk", 3)), device=device, ensemble=members)


class PainMlflowModel(mlflow.pyfunc.PythonModel):
    """Frames -> per-frame pain probability and decision (see the module docstring for the contract)."""

    def load_context(self, context) -> None:
        self.config = dict(context.model_config or {})
        members = [context.artifacts[name] for name in sorted(context.artifacts, key=_member_order)
                   if name.startswith(f"{WEIGHTS_ARTIFACT}_")]
        self.scorer = scorer_from_config(context.artifacts[WEIGHTS_ARTIFACT], self.config, ensemble_paths=members)

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return self.scorer.score(frames_from_input(model_input))


def model_config(train_cfg, class_names: list[str], threshold: float, rule) -> dict:
    """The MLflow model's `model_config`: how to crop like training did, and how to decide."""
    pre = train_cfg.preprocess
    min_face = float(OmegaConf.select(train_cfg, "predict.min_face_fraction", default=0.05))
    return {"threshold": float(threshold), "threshold_rule": str(rule), "aggregation": train_cfg.trainer.aggregation,
            "topk": int(train_cfg.trainer.topk), "class_names": list(class_names), "task": train_cfg.task.name,
            "crop": {"detector": pre.detector, "align": bool(pre.align), "margin": float(pre.margin),
                     "crop_size": int(pre.crop_size), "jpeg_quality": int(pre.jpeg_quality),
                     "min_face_fraction": min_face}}


def log_fold_model(cfg, weights_path: Path, fold: int, class_names: list[str], weights: dict[str, str],
                   threshold: float, rule: str):
    """A CV fold's kept model as an MLflow model in the active fold run (the UI's Models tab lists it), deciding at
    the threshold its validation subjects chose (`rule` as the fold run records it; 0.5 where there is none, as for
    five classes). Not registered."""
    metadata = {"fold": fold, "git_commit": git_commit(), "model": cfg.model.name, "task": cfg.task.name,
                "dataset": cfg.data.name, **weights}
    decided = float(threshold) if math.isfinite(threshold) else 0.5  # NaN: no threshold was chosen
    return log_mlflow_model(weights_path, model_config(cfg, class_names, decided, rule), metadata, name=f"fold_{fold}",
                          tags={"painvit.kind": "fold", "painvit.fold": str(fold)})


def _member_order(name: str) -> int:
    return int(name.rsplit("_", 1)[1]) if name.rsplit("_", 1)[-1].isdigit() else -1


def signature():
    """Input: `image` (base64 PNG/JPEG) or `path`; output: the per-frame table."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    inputs = Schema([ColSpec("string", "image", required=False), ColSpec("string", "path", required=False)])
    outputs = Schema([ColSpec("long", "frame"), ColSpec("boolean", "face_found"),
                      ColSpec("double", "pain_probability", required=False), ColSpec("boolean", "pain",
                                                                                    required=False)])
    return ModelSignature(inputs=inputs, outputs=outputs)


def synthetic_frames(n: int = 2, start: int = 60) -> list[np.ndarray]:
    """Frames of the synthetic twin (drawn faces; never BioVid's), for input examples and smoke checks."""
    from itertools import islice

    from pipeline.data.synthetic import PRESETS, make_samples, make_subjects, render_frames

    config = PRESETS["tiny"]
    subjects = make_subjects(config)
    sample = make_samples(config, subjects[:1])[-1]
    return [np.ascontiguousarray(f) for f in islice(render_frames(config, subjects[0], sample), start, start + n)]


def requirements() -> list[str]:
    """The scoring environment's packages at the versions installed here."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in REQUIREMENTS:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            continue
    return pins


def log_mlflow_model(weights_path: Path, config: dict[str, Any], metadata: dict[str, Any], name: str = "pain_model",
                   registered_model_name: str | None = None, tags: dict[str, str] | None = None,
                   ensemble_paths: Sequence[Path] = ()):
    """Log the model (from code) into the active run; returns MLflow's ModelInfo.

    The input example is two frames of the synthetic twin: drawn faces, never BioVid's. `registered_model_name`
    registers the model as a new version of that name.
    """
    example = pd.DataFrame({"image": [encode_image(f, ".jpg") for f in synthetic_frames()]})
    return mlflow.pyfunc.log_model(
        name=name, python_model=str(CODE_FILE),
        artifacts={WEIGHTS_ARTIFACT: str(weights_path),
                   **{f"{WEIGHTS_ARTIFACT}_{i}": str(p) for i, p in enumerate(ensemble_paths, start=1)}},
        model_config=config, metadata=metadata, signature=signature(), input_example=example,
        pip_requirements=requirements(), registered_model_name=registered_model_name, tags=tags)
