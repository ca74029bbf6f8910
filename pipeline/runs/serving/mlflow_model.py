"""The pain model as an MLflow Model: frames in, a pain probability and a decision per frame out.

It is logged as an MLflow "model from code" (`pipeline/runs/serving/mlflow_model_code.py` is the code file MLflow stores
with the model; it sets OpenCV's own pixel cap and instantiates `PainMlflowModel`). What MLflow stores besides:

- artifact `weights`: the kept model file (`pipeline.models.model_file`: state dict, backbone, input size, mean/std,
  crop window and fraction, class names, weights provenance), read with `weights_only=True`;
- `model_config`: the decision threshold and the rule that chose it, the video aggregation, how the training crops
  were made (detector, alignment, margin, crop size, JPEG quality), the smallest face searched for and the device
  (`min_face_fraction` and `device` can be overridden at load time: `load_scorer`);
- `metadata`: where the weights come from (source CV run, final or fold run, git commit), shown in the MLmodel file.

Input: a DataFrame, one row per frame in time order, with column `image` (the frame as a base64-encoded PNG or JPEG)
or column `path` (a PNG or JPEG file under the folder the scoring process allows, `ServingLimits.path_root`; off unless
set). Output: a DataFrame with `frame` (the row's position), `face_found`, `pain_probability` (1 - P(no pain)),
`pain` (probability >= threshold) and `no_score_reason`; a frame without a face (or without a finite probability) has
`pain_probability` and `pain` None, never NaN, which is not JSON, and the reason (`served_table`). The rows of one
request are one sequence: the same person is followed through them.

Requests that arrive together (the scoring server calls `predict` from many threads) each take a scorer of their own
from a pool (`pipeline.runs.serving.scorer_pool`, `serve.scorers` of them) once their frames' headers have passed the
limits, and only then decode their frames; waiting for a scorer counts against the request's time limit.

What one request may ask is bounded (`pipeline.runs.serving.serving_input.ServingLimits`, read when the model is
loaded): frames, pixels a frame and a request (read from each frame's header before it is decoded), the folder `path`
inputs may read, the seconds it may take (decoding included). A request over a limit, or with a frame that cannot be
read for any reason, gets a one-line `Refusal` (HTTP 400, 504 for the time limit) that names the row or the limit, never
a stack trace or a path of the server's: under `make serve` and under `mlflow models serve` alike.

Every way of scoring with a trained model (`make predict` with MODEL_URI=, RUN= or the champion, `make export`, the
served model) builds its `FrameScorer` through `build_scorer`, called by `PainMlflowModel.load_context`, and only after
`pipeline.runs.serving.model_trust.check_model_folder` found the model folder to be the project's (`load_scorer`; the
served model checks in `load_context`).
"""

from __future__ import annotations

import base64
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cv2
import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import DEADLINE_EXCEEDED, INTERNAL_ERROR, INVALID_PARAMETER_VALUE

from pipeline.data.personalise import not_served
from pipeline.models.model_file import load_model_file
from pipeline.models.scoring import OUTPUT_COLUMNS, CropSettings, FrameScorer
from pipeline.runs.serving.model_trust import CODE_FILE, check_model_folder
from pipeline.runs.serving.scorer_pool import ScorerPool
from pipeline.runs.serving.serving_input import (
    FrameRefused,
    ServingLimits,
    decode_frame,
    frame_size,
    one_line,
    read_beneath,
)
from pipeline.runs.store import tracking
from pipeline.utils.memory import Trimmer
from pipeline.utils.paths import git_commit

WEIGHTS_ARTIFACT = "weights"
# What the scoring process must have installed (the package itself brings the rest); pinned to what trained it.
REQUIREMENTS = ("torch", "torchvision", "timm", "transformers", "albumentations", "opencv-python-headless", "pandas",
                "numpy", "mtcnn", "joblib", "mlflow", "omegaconf", "ai-edge-litert")
SCORE_CHUNK = 8  # frames scored between two looks at the request's deadline
NO_SCORE_COLUMN = "no_score_reason"  # the answer's column that says why a frame has no probability (null if scored)
TRIM_INTERVAL_S = 0.5  # at most two trims of freed memory a second, after requests (pipeline.utils.memory)
NO_FACE = "no face found in this frame"
NOT_FINITE = "the network gave no finite probability for this frame"


class Refusal(MlflowException):
    """A request the model refuses, in one line: HTTP 400 (`INVALID_PARAMETER_VALUE`) unless `error_code` says
    otherwise. The message stays one line: MLflow's scoring server (`mlflow models serve`) rewrites an error's message
    as "Failed to predict data '<the request>'. \nError: <message>", an echo of the request over several lines;
    this message's setter keeps what `one_line` keeps of it."""

    def __init__(self, message: str, error_code: int = INVALID_PARAMETER_VALUE) -> None:
        super().__init__(message, error_code=error_code)

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        self._message = one_line(str(value))


def over_time(limit_s: float) -> Refusal:
    return Refusal(f"the request ran over its time limit of {limit_s:g} s ({ServingLimits.ENV['timeout_s']}); send "
                   f"fewer frames", error_code=DEADLINE_EXCEEDED)


def encode_image(frame_bgr: np.ndarray, fmt: str = ".png") -> str:
    """A BGR frame as base64 text (PNG: lossless, so the server sees the very pixels `make predict` sees)."""
    ok, encoded = cv2.imencode(fmt, frame_bgr)
    if not ok:
        raise ValueError(f"cannot encode a frame of shape {frame_bgr.shape} as {fmt}")
    return base64.b64encode(encoded.tobytes()).decode("ascii")


def image_bytes(value: str | bytes) -> bytes:
    """The bytes of an `image` value: base64 text (or bytes as they are)."""
    if isinstance(value, bytes):
        return value
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise FrameRefused("an 'image' value is not base64 text") from None


def frames_from_input(model_input: pd.DataFrame | list | dict, limits: ServingLimits, deadline: float | None = None,
                      limit_s: float | None = None) -> list[np.ndarray]:
    """The request's frames in row order, from column `image` (base64) or `path` (a file under `limits.path_root`),
    each read as `pipeline.runs.serving.serving_input` says: kind and size from its header, within the caps a frame and
    the request have, before it is decoded; at most `limits.max_frames` frames; stopped (504) once `deadline`
    (time.monotonic) has passed. Any failure is a `Refusal` of one line naming the row."""
    return decoded_frames(encoded_frames(model_input, limits, deadline, limit_s), deadline,
                          limit_s if limit_s is not None else limits.timeout_s)


def refused_row(row: int, error: Exception) -> Refusal:
    """The one-line refusal of a row whose frame could not be read, naming no file of the server's."""
    if isinstance(error, FrameRefused):
        return Refusal(f"row {row}: {error}")
    if isinstance(error, OSError):  # the reason only: an OSError's text names the file
        return Refusal(f"row {row}: the frame could not be read ({error.strerror or type(error).__name__})")
    # cv2.error, MemoryError, ...: their text may name the server's files
    return Refusal(f"row {row}: the frame could not be read ({type(error).__name__})")


def encoded_frames(model_input: pd.DataFrame | list | dict, limits: ServingLimits, deadline: float | None = None,
                   limit_s: float | None = None) -> list[tuple[bytes, int, int]]:
    """Every row's image bytes with the width and height its header says, each checked against the caps (a frame's,
    then the request's so far), nothing decoded yet: a request that is refused is refused before it waits for a
    scorer, and one that waits holds its compressed bytes only."""
    table = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
    if len(table) > limits.max_frames:
        raise Refusal(f"{len(table)} frames in one request; the limit is {limits.max_frames} "
                      f"({ServingLimits.ENV['max_frames']}): send the sequence in parts")
    encoded, pixels = [], 0
    for row, record in enumerate(table.to_dict("records")):
        if deadline is not None and time.monotonic() > deadline:
            raise over_time(limit_s if limit_s is not None else limits.timeout_s)
        try:
            data, width, height = read_encoded(record, limits, pixels)
        except Exception as error:
            raise refused_row(row, error) from None
        pixels += width * height
        encoded.append((data, width, height))
    return encoded


def decoded_frames(encoded: Sequence[tuple[bytes, int, int]], deadline: float | None,
                   limit_s: float) -> list[np.ndarray]:
    """The BGR frames of `encoded_frames`, decoded in row order until `deadline` (then 504)."""
    frames = []
    for row, (data, width, height) in enumerate(encoded):
        if deadline is not None and time.monotonic() > deadline:
            raise over_time(limit_s)
        try:
            frames.append(decode_frame(data, width, height))
        except Exception as error:
            raise refused_row(row, error) from None
    return frames


def read_encoded(record: Mapping[str, Any], limits: ServingLimits, pixels_before: int) -> tuple[bytes, int, int]:
    """One row's bytes, its kind and size from its header, and the caps: (bytes, width, height)."""
    image, path = record.get("image"), record.get("path")
    if isinstance(image, str | bytes) and len(image):
        data = image_bytes(image)
    elif isinstance(path, str) and path:
        data = read_beneath(path, limits.path_root, limits.max_body_bytes)
    else:
        raise FrameRefused("needs an 'image' (base64 PNG/JPEG) or a 'path' value")
    width, height = frame_size(data)
    limits.check_frame(width, height)
    if pixels_before + width * height > limits.max_request_pixels:
        raise FrameRefused(f"the request's frames would hold {pixels_before + width * height} pixels with this one; "
                           f"the limit is {limits.max_request_pixels} ({ServingLimits.ENV['max_request_pixels']}): "
                           f"send the sequence in parts")
    return data, width, height


def served_table(table: pd.DataFrame) -> pd.DataFrame:
    """What a request is answered: `OUTPUT_COLUMNS` and `NO_SCORE_COLUMN`, with no NaN anywhere (JSON has none, RFC
    8259; MLflow would write a float NaN as the bare word NaN, which strict parsers refuse): a frame without a finite
    probability has `pain_probability` and `pain` None (null) and the reason; a scored one has the reason None."""
    probability = table["pain_probability"].to_numpy(dtype=float)
    scored = np.isfinite(probability)
    found = table["face_found"].to_numpy(dtype=bool)
    served = table[list(OUTPUT_COLUMNS)].copy()
    served["pain_probability"] = pd.Series([float(p) if ok else None for p, ok in zip(probability, scored,
                                                                                    strict=True)], dtype=object)
    served["pain"] = pd.Series([bool(p) if ok else None for p, ok in zip(table["pain"], scored, strict=True)],
                               dtype=object)
    served[NO_SCORE_COLUMN] = pd.Series([None if ok else NO_FACE if not face else NOT_FINITE
                                         for ok, face in zip(scored, found, strict=True)], dtype=object)
    return served


def member_order(name: str) -> int:
    """Ensemble members are artifacts `weights_1`, `weights_2`, ...: their order, -1 for anything else."""
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if name.startswith(f"{WEIGHTS_ARTIFACT}_") and tail.isdigit() else -1


def score_within(scorer: FrameScorer, frames: Sequence[np.ndarray], deadline: float, limit_s: float) -> pd.DataFrame:
    """`scorer.score(frames)` in chunks, one person followed through them, stopped with a one-line error (HTTP 504)
    once `deadline` (time.monotonic) has passed: a slow request frees the server instead of holding it. A chunk that
    fails is a one-line error (HTTP 500) naming its rows, never a stack trace."""
    follower = scorer.follower()
    parts = []
    for start in range(0, max(len(frames), 1), SCORE_CHUNK):
        if time.monotonic() > deadline:
            raise over_time(limit_s)
        chunk = frames[start:start + SCORE_CHUNK]
        try:
            parts.append(scorer.score(chunk, follower))
        except Exception as error:
            raise Refusal(f"rows {start}-{start + max(len(chunk), 1) - 1}: the frames could not be scored "
                          f"({type(error).__name__})", error_code=INTERNAL_ERROR) from None
    table = pd.concat(parts, ignore_index=True)
    table["frame"] = np.arange(len(table))
    return table


def build_scorer(artifacts: Mapping[str, str | Path], config: Mapping[str, Any]) -> FrameScorer:
    """The scorer of an MLflow pain model, from its artifacts (`weights`, and `weights_<i>` for the other members of
    a fold ensemble, whose class probabilities are averaged) and its model_config: threshold, aggregation, topk,
    crop settings, and the load-time `device` and `min_face_fraction`. The one place a scorer is made."""
    net, meta = load_model_file(Path(artifacts[WEIGHTS_ARTIFACT]))
    members = [load_model_file(Path(artifacts[name]))[0]
               for name in sorted(artifacts, key=member_order) if member_order(name) >= 0]
    crop = dict(config.get("crop", {}))
    if config.get("min_face_fraction") is not None:
        crop["min_face_fraction"] = float(config["min_face_fraction"])
    return FrameScorer(net, meta, CropSettings.from_dict(crop), threshold=float(config.get("threshold", 0.5)),
                       aggregation=config["aggregation"], topk=int(config["topk"]),
                       device=str(config.get("device", "cpu")), ensemble=members)


class PainMlflowModel(mlflow.pyfunc.PythonModel):
    """Frames -> per-frame pain probability and decision (see the module docstring for the contract)."""

    def load_context(self, context) -> None:
        self.config = dict(context.model_config or {})
        self.artifacts = dict(context.artifacts)
        self.model_dir = model_root(Path(self.artifacts[WEIGHTS_ARTIFACT]))
        # the project's say under `mlflow models serve`, which loads the model without asking the project first
        check_model_folder(self.model_dir or Path(self.artifacts[WEIGHTS_ARTIFACT]).parent)
        self.limits = ServingLimits.from_env()
        self.start_scoring()

    def start_scoring(self) -> None:
        """The scorer of the model's files and settings (`build_scorer`), and the pool from which each request that
        `predict` answers takes a scorer of its own (`ScorerPool`: the scoring server calls it from many threads)."""
        self.scorer = build_scorer(self.artifacts, self.config)
        self.pool = ScorerPool(self.scorer, lambda: build_scorer(self.artifacts, self.config), self.limits.scorers)
        self.trimmer = Trimmer(TRIM_INTERVAL_S)

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """The frames' table (`served_table`); `params={"timeout_s": s}` shortens (never lengthens) this request's
        time limit, which covers reading the frames, waiting for a scorer, decoding and scoring."""
        started = time.monotonic()
        if self.scorer.personalise.personal:  # `mlflow models serve` of one: every request gets this answer
            raise Refusal(not_served(self.scorer.personalise))
        limits = self.limits
        asked = float((params or {}).get("timeout_s") or 0.0)
        limit_s = min(limits.timeout_s, asked) if asked > 0 else limits.timeout_s
        deadline = started + limit_s
        encoded = encoded_frames(model_input, limits, deadline, limit_s)
        try:
            scorer = self.pool.take(deadline - time.monotonic())
        except TimeoutError:
            raise over_time(limit_s) from None
        try:
            table = score_within(scorer, decoded_frames(encoded, deadline, limit_s), deadline, limit_s)
        finally:
            self.pool.give_back(scorer)
            self.trimmer.wanted()  # what decoding and scoring freed, back to the system (pipeline.utils.memory)
        return served_table(table)


def model_root(artifact: Path) -> Path | None:
    """The folder of the MLflow model (the one holding `MLmodel`) an artifact of it lies in; None if none does."""
    return next((folder for folder in artifact.parents if (folder / "MLmodel").is_file()), None)


def requirement_mismatches(model_dir: Path | None) -> list[str]:
    """The model's pinned requirements (its requirements.txt) that this environment does not satisfy, one line
    each: what MLflow's own load-time check reports, read from the installed distributions' versions directly
    (MLflow's maps every installed package to its modules first: two seconds of every `make predict`)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    path = model_dir / "requirements.txt" if model_dir else None
    if path is None or not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            found.append(f"{requirement} (not installed)")
            continue
        try:
            public = Version(installed).public  # 2.14.1+cu130 satisfies torch==2.14.1, as MLflow has it
        except InvalidVersion:
            continue
        if requirement.specifier and not requirement.specifier.contains(public, prereleases=True):
            found.append(f"{requirement} (installed: {installed})")
    return found


def load_scorer(model_uri: str, device: str = "cpu", min_face_fraction: float | None = None) -> FrameScorer:
    """The scorer of the MLflow pain model at `model_uri` (models:/..., runs:/..., a path): the model folder fetched
    and found to be the project's (`model_trust.check_model_folder`: UntrustedModel, with the reason, otherwise),
    then loaded by MLflow's own pyfunc loader (`PainMlflowModel.load_context` -> `build_scorer`), with the device and
    smallest face overridden. Requirements the environment does not meet are warned about, as MLflow's loader
    would."""
    overrides: dict[str, Any] = {"device": device}
    if min_face_fraction is not None:
        overrides["min_face_fraction"] = float(min_face_fraction)
    local = mlflow.artifacts.download_artifacts(artifact_uri=model_uri)  # a local folder: itself, not a copy
    check_model_folder(local)
    model = mlflow.pyfunc.load_model(local, model_config=overrides, suppress_warnings=True)
    python_model = model.unwrap_python_model()
    if not isinstance(python_model, PainMlflowModel):
        raise TypeError(f"{model_uri} is not a pain model (its python model is {type(python_model).__name__})")
    mismatches = requirement_mismatches(python_model.model_dir)
    if mismatches:
        warnings.warn(f"{model_uri} was saved with packages this environment does not have: "
                      f"{'; '.join(mismatches)}. It may score differently or fail to load.", UserWarning, stacklevel=2)
    if any(python_model.config.get(key) != value for key, value in overrides.items()):
        # logged before `device` and `min_face_fraction` were model_config keys: MLflow ignores overrides of
        # keys a model lacks, so the scorer is made again with them
        python_model.config = {**python_model.config, **overrides}
        python_model.start_scoring()
    return python_model.scorer


def logged_model_uri(client, run_id: str) -> str | None:
    """`models:/<model id>` of the MLflow model a fold or final run logged (its newest), or None."""
    run = client.get_run(run_id)
    outputs = getattr(run, "outputs", None)
    model_ids = [output.model_id for output in (outputs.model_outputs if outputs else [])]
    if not model_ids:
        found = client.search_logged_models([run.info.experiment_id],
                                            filter_string=f"source_run_id = '{run_id}'", max_results=1)
        model_ids = [model.model_id for model in found]
    return f"models:/{model_ids[-1]}" if model_ids else None


def model_config(config: Mapping[str, Any], class_names: list[str], threshold: float, rule) -> dict:
    """The MLflow model's `model_config`: how to crop like training did, and how to decide. `config`: the training's
    resolved config (a mapping: the composed config or the dict a job carries)."""
    pre = config["preprocess"]
    min_face = float(config["predict"]["min_face_fraction"])
    return {"threshold": float(threshold), "threshold_rule": str(rule), "aggregation": config["trainer"]["aggregation"],
            "topk": int(config["trainer"]["topk"]), "class_names": list(class_names), "task": config["task"]["name"],
            "device": "cpu", "min_face_fraction": min_face,
            "crop": {"detector": pre["detector"], "align": bool(pre["align"]), "margin": float(pre["margin"]),
                     "crop_size": int(pre["crop_size"]), "jpeg_quality": int(pre["jpeg_quality"]),
                     "min_face_fraction": min_face}}


def log_fold_model(config: Mapping[str, Any], weights_path: Path, fold: int, class_names: list[str],
                   weights: dict[str, str], threshold: float, rule: str):
    """A CV fold's kept model as an MLflow model in the active fold run (the UI's Models tab lists it), deciding at
    the threshold its validation subjects chose (`rule` as the fold run records it; 0.5 where there is none, as for
    five classes). Not registered."""
    metadata = {"fold": fold, "git_commit": git_commit(), "model": config["model"]["name"],
                "task": config["task"]["name"], "dataset": config["data"]["name"], **weights}
    decided = float(threshold) if math.isfinite(threshold) else 0.5  # NaN: no threshold was chosen
    return log_mlflow_model(weights_path, model_config(config, class_names, decided, rule), metadata,
                            name=f"fold_{fold}",
                            tags={tracking.MODEL_KIND_TAG: tracking.FOLD_MODEL, tracking.MODEL_FOLD_TAG: str(fold)},
                            with_example=False)


def signature():
    """Input: `image` (base64 PNG/JPEG) or `path`; param `timeout_s` (a shorter time limit); output: the per-frame
    table."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    inputs = Schema([ColSpec("string", "image", required=False), ColSpec("string", "path", required=False)])
    outputs = Schema([ColSpec("long", "frame"), ColSpec("boolean", "face_found"),
                      ColSpec("double", "pain_probability", required=False), ColSpec("boolean", "pain", required=False),
                      ColSpec("string", NO_SCORE_COLUMN, required=False)])
    params = ParamSchema([ParamSpec("timeout_s", "double", 0.0)])  # 0: the server's limit
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


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
                   ensemble_paths: Sequence[Path] = (), with_example: bool = True):
    """Log the model (from code) into the active run; returns MLflow's ModelInfo.

    The input example is two frames of the synthetic twin: drawn faces, never BioVid's. MLflow checks it by loading
    the model and scoring it, seconds per model: fold models (`with_example=False`) skip it, the final model that
    gets served keeps it. `registered_model_name` registers the model as a new version of that name.
    """
    example = (pd.DataFrame({"image": [encode_image(f, ".jpg") for f in synthetic_frames()]}) if with_example
               else None)
    return mlflow.pyfunc.log_model(
        name=name, python_model=str(CODE_FILE),
        artifacts={WEIGHTS_ARTIFACT: str(weights_path),
                   **{f"{WEIGHTS_ARTIFACT}_{i}": str(p) for i, p in enumerate(ensemble_paths, start=1)}},
        model_config=config, metadata=metadata, signature=signature(), input_example=example,
        pip_requirements=requirements(), registered_model_name=registered_model_name, tags=tags)
