"""From video frames to a pain probability per frame: find the face, follow one person, crop it as training did, run
the network. One implementation serves `make predict`, the MLflow model (`pipeline.runs.serving.mlflow_model`) and the
benchmark, so a served answer and a predicted CSV agree on the same frames.

The crop repeats preprocessing (`pipeline.data.face_crops.crop_video`): aligned on MTCNN's five landmarks (or a square
around the box for a model trained on square crops) with the training margin and crop size, JPEG-encoded at the
training quality, then the evaluation transform of the kept model (central crop fraction, resize, mean/std). Three
things differ on purpose: the smallest face searched for is a setting of its own (`min_face_fraction`, 5 % of the
shorter side by default, where BioVid's crops search from 10 %); boxes are not smoothed over time (frames of a new
recording may be seconds apart or absent, and each scored frame should show that frame's face); and a frame where
MTCNN finds no face is searched again, rotated, then by a second detector (`FaceFinder`), whose landmarks make the
same aligned crop.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import pandas as pd
import torch

from pipeline.data.augment import build_eval_transform, opencv_name
from pipeline.data.crop_geometry import (
    ALIGN_INTERPOLATION,
    CROP_BORDER,
    SQUARE_GROW_INTERPOLATION,
    SQUARE_SHRINK_INTERPOLATION,
    aligned_crop,
    alignment_target,
    square_crop,
)
from pipeline.data.faces import LANDMARK_NAMES, plausibility, retry_rotated
from pipeline.data.personalise import PersonaliseConfig, ReferenceStatistics, no_reference
from pipeline.data.tasks import no_pain_index
from pipeline.evaluation.aggregation import aggregate_class_probabilities, check_aggregation, pain_probability
from pipeline.models.backbones import PainNet
from pipeline.models.clip_window import ClipWindow
from pipeline.models.model_file import clip_frames_of, clip_spacing_of, data_config_of
from pipeline.models.ordinal import OutputConfig, output_probabilities
from pipeline.models.temporal_heads import ClipNet

OUTPUT_COLUMNS = ("frame", "face_found", "pain_probability", "pain")
WINDOW_COLUMN = "window_faces"  # a clip model's row: how many frames with a face its window held (NaN without a face)


@dataclass(frozen=True)
class CropSettings:
    """How the training crops were made (the CV's `preprocess.*`), and how faces are searched for here."""

    detector: str = "mtcnn"
    align: bool = True
    margin: float = 0.2
    crop_size: int = 224
    jpeg_quality: int = 95
    min_face_fraction: float = 0.05  # the smallest face searched for, as a fraction of the frame's shorter side
    max_side: int = 720  # frames are halved until their longer side is at most this before detection
    max_jump: float = 1.0  # a detection further than this many face sides from the followed face is someone else
    reacquire_after: int = 10  # after this many frames without the followed face, follow the most plausible one
    # a frame where MTCNN finds no face is detected again rotated by these angles in turn (scripts/bench_detectors.py:
    # on real photographs rolled 35-50 degrees, or grey, MTCNN alone finds 47-78 %, with these retries all)
    retry_rolls: tuple[float, ...] = (25.0, -25.0)
    # a frame where the detector (and its retries) still finds no face is searched by this registered detector
    # (pipeline.data.faces.DETECTORS); None: no second search. BlazeFace full-range finds small faces in soft, grainy,
    # low-contrast frames that MTCNN loses (tests/test_blazeface.py); the crops of a model trained on MTCNN's stay
    # MTCNN's wherever MTCNN finds the face
    fallback_detector: str | None = "blazeface"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CropSettings:
        known = {k: values[k] for k in cls.__dataclass_fields__ if k in values and values[k] is not None}
        if "retry_rolls" in known:
            known["retry_rolls"] = tuple(float(angle) for angle in known["retry_rolls"])
        if "fallback_detector" in values and values["fallback_detector"] is None:
            known["fallback_detector"] = None  # asked for no second search, not for the default
        return cls(**known)


def crop_contract(settings: CropSettings) -> dict[str, Any]:
    """How a video frame becomes the face crop the evaluation transform takes (`FrameScorer.crop`, and the crop stage
    `pipeline.data.face_crops.crop_video` for training), as plain values: the settings, and the rules and OpenCV
    flags of `pipeline.data.faces` with the numbers they use."""
    s = settings
    border = opencv_name(CROP_BORDER, "BORDER")
    detector: dict[str, Any] = {"name": s.detector, "min_face_fraction": s.min_face_fraction}
    if s.detector == "mtcnn":
        import inspect

        from pipeline.data.mtcnn import MTCNN, WEIGHTS_PACKAGE, WEIGHTS_SHA256

        defaults = inspect.signature(MTCNN).parameters
        detector |= {"implementation": f"pipeline.data.mtcnn: MTCNN with the weights of the {WEIGHTS_PACKAGE} "
                                       f"package", "weights_sha256": dict(WEIGHTS_SHA256), "max_side": s.max_side,
                     "thresholds": list(defaults["thresholds"].default),
                     "scale_factor": defaults["scale_factor"].default,
                     "retry_rolls_deg": list(s.retry_rolls), "retry": "a frame without a face is detected again "
                                                                      "rotated by each of retry_rolls_deg in turn",
                     "landmarks": list(LANDMARK_NAMES), "landmarks_note": "left and right as seen in the image"}
    detector |= {"max_jump": s.max_jump, "reacquire_after": s.reacquire_after,
                 "follow": f"one person per video (FaceFollower): the most plausible face first "
                           f"(pipeline.data.faces.plausibility), then in each frame the face nearest the last one "
                           f"followed, its centre within {s.max_jump} face sides; after {s.reacquire_after} frames "
                           f"without it, the most plausible face again"}
    if s.align:
        interpolation = opencv_name(ALIGN_INTERPOLATION, "INTER")
        crop: dict[str, Any] = {
            "method": "aligned", "target_points_xy": alignment_target(s.margin, s.crop_size).tolist(),
            "fit": "the least-squares similarity (rotation, uniform scale, translation; no reflection) taking the "
                   "five landmarks P (frame pixels, (5, 2), `landmarks` order) onto Q = target_points_xy, Umeyama's "
                   "closed form in float64: p, q = the means; C = (Q - q).T @ (P - p) / 5; U, d, Vt = svd(C); "
                   "E = diag(1, -1 if det(U) * det(Vt) < 0 else 1); R = U @ E @ Vt; "
                   "c = trace(diag(d) @ E) / (sum((P - p) ** 2) / 5); M = [c R | q - c R p] (2 x 3)",
            "interpolation": interpolation, "border_mode": border,
            "call": f"cv2.warpAffine(frame_bgr, M, ({s.crop_size}, {s.crop_size}), flags=cv2.{interpolation}, "
                    f"borderMode=cv2.{border})"}
    else:
        shrink = opencv_name(SQUARE_SHRINK_INTERPOLATION, "INTER")
        grow = opencv_name(SQUARE_GROW_INTERPOLATION, "INTER")
        crop = {"method": "square", "shrink_interpolation": shrink, "grow_interpolation": grow, "border_mode": border,
                "box": "the detector's box x1, y1, x2, y2 as x = round(x1), y = round(y1), w = max(1, round(x2 - x1)),"
                       " h = max(1, round(y2 - y1)) (round half to even)",
                "square": "side = max(1, round(max(w, h) * (1 + 2 * margin))), left = floor(x + w / 2 - side / 2), "
                          "top = floor(y + h / 2 - side / 2); pixels outside the frame repeat its border "
                          f"(cv2.copyMakeBorder, cv2.{border})",
                "resize": f"cv2.resize to ({s.crop_size}, {s.crop_size}): cv2.{shrink} when side > {s.crop_size}, "
                          f"cv2.{grow} when smaller, none when equal"}
    return {
        "frame": "a video frame as OpenCV decodes it: HWC uint8 BGR",
        "detector": detector, "align": s.align, "margin": s.margin, "crop_size": s.crop_size, "crop": crop,
        "jpeg": {"quality": s.jpeg_quality,
                 "encode": f"cv2.imencode('.jpg', crop_bgr, [cv2.IMWRITE_JPEG_QUALITY, {s.jpeg_quality}]) (OpenCV "
                           f"{cv2.__version__}'s other defaults: baseline, 4:2:0 chroma subsampling)",
                 "decode": "cv2.imdecode(encoded, cv2.IMREAD_COLOR) (BGR), then cv2.cvtColor(..., cv2.COLOR_BGR2RGB)"},
        "scored_on": "the decoded JPEG, never the raw crop: training read the crop stage's JPEG files "
                     "(cv2.imread(path, cv2.IMREAD_COLOR), then BGR -> RGB); predict and the served model encode and "
                     "decode each crop in memory the same way",
        "smoothing": "the training crops' boxes and landmarks were smoothed over each video's sampled frames "
                     "(preprocess.smoothing); predict does not smooth: each frame's own face",
    }


@dataclass
class Timings:
    """Seconds spent per stage, summed over calls (the benchmark reports them per frame)."""

    detect: float = 0.0
    align: float = 0.0
    network: float = 0.0
    frames: int = 0

    def per_frame(self) -> dict[str, float]:
        n = max(1, self.frames)
        return {"detect_s": self.detect / n, "align_s": self.align / n, "network_s": self.network / n}


class FaceFollower:
    """One face per frame, always the same person's: the most plausible face first, then in each frame the detection
    nearest the last followed face (its centre within `max_jump` face sides); a frame where only others are seen has
    no face. After `reacquire_after` frames without the person, the most plausible face is followed again. Keeps its
    state between calls, so a long video can be scored chunk by chunk; for a clip model it also keeps the embeddings
    of the person's recent crops (`ClipWindow`)."""

    def __init__(self, max_jump: float = 1.0, reacquire_after: int = 10, window_frames: int = 1,
                 spacing_s: float | None = None) -> None:
        self.max_jump, self.reacquire_after = max_jump, reacquire_after
        self.previous: np.ndarray | None = None
        self.missing = 0
        self.window = ClipWindow(window_frames, spacing_s)

    def step(self, found: np.ndarray) -> np.ndarray | None:
        pick = None
        if len(found):
            if self.previous is None:
                pick = found[int(np.argmax(plausibility(found)))]
            else:
                previous = self.previous
                centres = np.stack([(found[:, 0] + found[:, 2]) / 2, (found[:, 1] + found[:, 3]) / 2], 1)
                centre = np.array([(previous[0] + previous[2]) / 2, (previous[1] + previous[3]) / 2])
                side = max(previous[2] - previous[0], previous[3] - previous[1], 1.0)
                distance = np.linalg.norm(centres - centre, axis=1) / side
                nearest = int(np.argmin(distance))
                pick = found[nearest] if distance[nearest] <= self.max_jump else None
        if pick is None:
            self.missing += 1
            if self.missing >= self.reacquire_after:
                self.previous = None
        else:
            self.previous, self.missing = pick, 0
        return pick


class FaceFinder:
    """Every face of every frame, as `make predict` searches for them: the model's detector (MTCNN with its rotated
    retries, or another registered detector), then, on the frames where it found none, `settings.fallback_detector`.
    Both are built on first use; a fallback whose runtime or weights are not installed is said once, as a warning with
    the reason, and the frames it would have searched stay without a face (other weights than the pinned ones, or
    bad settings, are errors)."""

    def __init__(self, settings: CropSettings, device: str = "cpu") -> None:
        from pipeline.data.faces import gives_landmarks

        self.settings, self.device = settings, device
        fallback = settings.fallback_detector
        if fallback is not None and not gives_landmarks(fallback) and settings.align:  # an unknown name: an error
            raise ValueError(f"fallback_detector={fallback!r} gives only a box, and this model's crops are aligned on "
                             "landmarks: name a detector that places them (blazeface, mtcnn) or none")
        self._detector: Any = None
        self._fallback: Any = None
        self.fallback_error: str | None = None  # why the fallback could not be built, once it was tried
        self.fallback_searched: list[int] = []  # the frames of the last `find` the first detector found no face in

    def detector(self):
        """MTCNN (every face of a frame, with landmarks), or the registered detector the model's crops were made
        with (Haar's cascade: box only)."""
        if self._detector is None:
            if self.settings.detector == "mtcnn":
                from pipeline.data.mtcnn import MTCNN

                self._detector = MTCNN(self.device, min_face_fraction=self.settings.min_face_fraction,
                                       max_side=self.settings.max_side)
            else:
                from pipeline.data.faces import build_detector

                self._detector = build_detector(self.settings.detector,
                                                min_size_fraction=self.settings.min_face_fraction)
        return self._detector

    def fallback(self):
        """The second detector, or None (none asked for, or it cannot be built: `fallback_error` says why)."""
        name = self.settings.fallback_detector
        if name is None or self.fallback_error is not None:
            return None
        if self._fallback is None:
            from pipeline.data.faces import build_detector

            try:
                self._fallback = build_detector(name, min_size_fraction=self.settings.min_face_fraction)
            except (ImportError, FileNotFoundError) as error:  # its runtime or weights not installed
                self.fallback_error = f"{type(error).__name__}: {error}"
                warnings.warn(f"the fallback face detector {name!r} is not available, so frames the "
                              f"{self.settings.detector} detector finds no face in stay without one: "
                              f"{self.fallback_error}", UserWarning, stacklevel=3)
                return None
        return self._fallback

    def build(self) -> None:
        """Both detectors built now rather than on first use: a scoring server builds its scorers while others score,
        and a network built meanwhile on another thread would see the meta device `load_model_file` builds on."""
        self.detector()
        self.fallback()

    def find(self, frames_bgr: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every face of every frame as rows (x1, y1, x2, y2, score, 5 landmark x, 5 landmark y); frames of
        different sizes are detected in runs of equal size."""
        from pipeline.data.faces import face_rows

        detector = self.detector()
        found: list[np.ndarray] = []
        start = 0
        while start < len(frames_bgr):
            end = start + 1
            while (end < len(frames_bgr) and end - start < 16
                   and frames_bgr[end].shape == frames_bgr[start].shape):
                end += 1
            batch = list(frames_bgr[start:end])
            if self.settings.detector == "mtcnn":
                found += retry_rotated(detector.detect, batch, detector.detect(batch), self.settings.retry_rolls)
            else:
                found += face_rows(detector, batch)
            start = end
        missed = [index for index, rows in enumerate(found) if not len(rows)]
        self.fallback_searched = missed
        fallback = self.fallback() if missed else None
        if fallback is not None:
            for index, rows in zip(missed, face_rows(fallback, [frames_bgr[i] for i in missed]), strict=True):
                found[index] = rows
        return found


class FrameScorer:
    """A kept model plus its crop settings: `score(frames)` -> one row per frame (see `OUTPUT_COLUMNS`).

    A clip model (`ClipNet`) scores a sliding window instead: each frame with a face is scored with a clip of T
    crops of the face ending with it (T = the model's `loader.clip_frames`), spaced in time as its training clips were
    (`ClipWindow`; fewer at the start of a video), so the timeline has one window score per step, and
    `WINDOW_COLUMN` says how many crops the window held.

    A personalised model (`meta["personalise"]`, `pipeline.data.personalise`) scores a crop's backbone features as
    its protocol showed them to the head in training, against the person's `reference` (set before scoring: `make
    predict REFERENCE=`); without one, scoring is an error that says what to give.
    """

    def __init__(self, net: PainNet | ClipNet, meta: dict[str, Any], settings: CropSettings, *, aggregation: str,
                 topk: int, threshold: float = 0.5, device: str = "cpu", batch_size: int = 32,
                 ensemble: Sequence[PainNet] = ()) -> None:
        self.net = net.eval().to(device)
        # a fold ensemble: every network sees the same crop, their class probabilities are averaged
        self.ensemble = [member.eval().to(device) for member in ensemble]
        self.meta = meta
        self.settings = settings
        self.threshold = float(threshold)
        check_aggregation(aggregation, int(topk))
        self.aggregation, self.topk = aggregation, int(topk)
        self.device = device
        self.batch_size = batch_size
        self.class_names = list(meta["class_names"])
        crop_fraction = (meta.get("loader") or {}).get("crop_fraction") or 1.0
        self.transform = build_eval_transform(data_config_of(meta), float(crop_fraction))
        self.timings = Timings()
        self.faces = FaceFinder(settings, device)
        self.clip_frames = clip_frames_of(meta)
        self.output = OutputConfig.from_config(meta.get("output"))  # softmax, or an ordinal / regression output
        if self.clip_frames is not None and self.ensemble:
            raise ValueError("a fold ensemble of clip models is not supported; score one clip model")
        self.personalise = PersonaliseConfig.from_config(meta.get("personalise"))
        self.reference: ReferenceStatistics | None = None  # a personalised model's person (`make predict REFERENCE=`)
        if self.personalise.personal and self.ensemble:
            raise ValueError(f"personalise={self.personalise.label}: a personalised model scores one network")

    @property
    def no_pain_index(self) -> int:
        return no_pain_index(self.class_names)

    def pain_scores(self, class_probs: np.ndarray) -> np.ndarray:
        """The pain probability of rows of class probabilities (N, C): 1 - P(no pain) for a softmax model; for an
        ordinal or regression model P(level >= pain_level) of its level probabilities (1 - P(BL1) at level 1)."""
        if self.output.pain_level is None:
            return 1.0 - class_probs[:, self.no_pain_index]
        return pain_probability(class_probs, self.output.pain_level)

    def find_faces(self, frames_bgr: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every face of every frame (`FaceFinder.find`)."""
        return self.faces.find(frames_bgr)

    def crop(self, frame_bgr: np.ndarray, face: np.ndarray) -> np.ndarray:
        """The face as the network saw its training crops: an RGB crop after the JPEG round trip."""
        s = self.settings
        if s.align:
            landmarks = np.stack([face[5:10], face[10:15]], axis=1)
            crop, _ = aligned_crop(frame_bgr, landmarks, margin=s.margin, size=s.crop_size)
        else:
            x1, y1, x2, y2 = (float(v) for v in face[:4])
            box = (round(x1), round(y1), max(1, round(x2 - x1)), max(1, round(y2 - y1)))
            crop = square_crop(frame_bgr, box, margin=s.margin, size=s.crop_size)
        ok, encoded = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, s.jpeg_quality])
        if not ok:
            raise RuntimeError("JPEG encoding of a face crop failed")
        return cv2.cvtColor(cv2.imdecode(encoded, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)

    def batches(self, crops_rgb: Sequence[np.ndarray]) -> Iterator[torch.Tensor]:
        """The crops through the evaluation transform, `batch_size` at a time, on the device."""
        for start in range(0, len(crops_rgb), self.batch_size):
            images = [self.transform(image=c)["image"] for c in crops_rgb[start:start + self.batch_size]]
            yield torch.stack(images).to(self.device)

    @torch.inference_mode()
    def embeddings(self, crops_rgb: Sequence[np.ndarray]) -> np.ndarray:
        """Each crop's backbone features (N, D), as the embedding cache holds a training crop's."""
        parts = [self.net.backbone(batch).float().cpu().numpy() for batch in self.batches(crops_rgb)]
        return np.concatenate(parts) if parts else np.empty((0, self.net.backbone.num_features))

    def personal(self, features: np.ndarray) -> torch.Tensor:
        """Backbone features (N, D) as a personalised model's head saw them in training: against the person's
        reference (`ReferenceStatistics.applied`); an error saying what to give without one."""
        if self.reference is None:
            raise ValueError(no_reference(self.personalise))
        features = self.reference.applied(features, self.personalise)
        return torch.as_tensor(features, dtype=torch.float32, device=self.device)

    @torch.inference_mode()
    def personal_probabilities(self, crops_rgb: Sequence[np.ndarray]) -> np.ndarray:
        """A personalised frame model's class probabilities (N, C): its head over each crop's `personal` features."""
        logits = self.net.head(self.personal(self.embeddings(crops_rgb)))
        return output_probabilities(self.net.head, logits.float()).cpu().numpy()

    @torch.inference_mode()
    def class_probabilities(self, crops_rgb: Sequence[np.ndarray]) -> np.ndarray:
        """Each crop's class probabilities (shape (N, C)), averaged over the ensemble's networks."""
        if not crops_rgb:
            return np.empty((0, len(self.class_names)))
        if self.personalise.personal:
            return self.personal_probabilities(crops_rgb)
        out = []
        for batch in self.batches(crops_rgb):
            probs = [output_probabilities(n.head, n(batch).float()).cpu().numpy() for n in (self.net, *self.ensemble)]
            out.append(np.mean(probs, axis=0))
        return np.concatenate(out)

    def probabilities(self, crops_rgb: Sequence[np.ndarray]) -> np.ndarray:
        """Pain probability (1 - P(no pain); an ordinal model's P(level >= pain_level)) of each crop."""
        return self.pain_scores(self.class_probabilities(crops_rgb))

    @torch.inference_mode()
    def window_probabilities(self, crops_rgb: Sequence[np.ndarray], follower: FaceFollower,
                             times_s: Sequence[float] | None = None) -> tuple[np.ndarray, list[int]]:
        """A clip model's class probabilities (N, C), one per crop: of the window ending with it (`ClipWindow`, the
        follower's, carried over from earlier chunks), and how many crops each window held."""
        assert isinstance(self.net, ClipNet)
        out, sizes = [], []
        for start, batch in zip(range(0, len(crops_rgb), self.batch_size), self.batches(crops_rgb), strict=True):
            embeddings = self.net.backbone(batch).float()
            if self.personalise.personal:  # each crop against the person's reference, as its clips were
                embeddings = self.personal(embeddings.cpu().numpy())
            for offset, embedding in enumerate(embeddings):
                window = follower.window.add(embedding, None if times_s is None else times_s[start + offset])
                logits = self.net.forward_embeddings(torch.stack(window)[None])
                out.append(output_probabilities(self.net.head, logits.float()).cpu().numpy()[0])
                sizes.append(len(window))
        return (np.stack(out) if out else np.empty((0, len(self.class_names)))), sizes

    def follower(self) -> FaceFollower:
        return FaceFollower(self.settings.max_jump, self.settings.reacquire_after, self.clip_frames or 1,
                            clip_spacing_of(self.meta))

    def score(self, frames_bgr: Sequence[np.ndarray], follower: FaceFollower | None = None,
              times_s: Sequence[float] | None = None) -> pd.DataFrame:
        """One row per frame, in order: frame (position), face_found, pain_probability (NaN without a face),
        pain (probability >= threshold; None without a face) and prob_<class> for each class (what `video_score`
        aggregates). Pass one `follower` to successive calls to follow the same person through a video scored in
        chunks, and the frames' `times_s` (seconds) so a clip model's windows have its training clips' spacing."""
        started = time.perf_counter()
        follower = follower or self.follower()
        faces = [follower.step(found) for found in self.find_faces(frames_bgr)]
        detected = time.perf_counter()
        with_face = [i for i, face in enumerate(faces) if face is not None]
        crops = [self.crop(frames_bgr[i], faces[i]) for i in with_face]
        cropped = time.perf_counter()
        windows = []
        if self.clip_frames is None:
            class_probs = self.class_probabilities(crops)
        else:  # each crop's window: its scores and how many crops it held
            crop_times = None if times_s is None else [float(times_s[i]) for i in with_face]
            class_probs, windows = self.window_probabilities(crops, follower, crop_times)
        finished = time.perf_counter()
        self.timings.detect += detected - started
        self.timings.align += cropped - detected
        self.timings.network += finished - cropped
        self.timings.frames += len(frames_bgr)
        per_class = np.full((len(frames_bgr), len(self.class_names)), np.nan)
        per_class[with_face] = class_probs
        probability = self.pain_scores(per_class)
        found = np.zeros(len(frames_bgr), dtype=bool)
        found[with_face] = True
        pain = [bool(p >= self.threshold) if f else None for p, f in zip(probability, found, strict=True)]
        table = pd.DataFrame({"frame": np.arange(len(frames_bgr)), "face_found": found,
                              "pain_probability": probability, "pain": pain})
        for column, name in enumerate(self.class_names):
            table[f"prob_{name}"] = per_class[:, column]
        if self.clip_frames is not None:
            table[WINDOW_COLUMN] = np.nan
            table.loc[with_face, WINDOW_COLUMN] = windows
        return table

    def video_score(self, frames: pd.DataFrame) -> float:
        """The video's pain score from the class probabilities of its frames with a face (`score`'s prob_<class>
        columns), aggregated by the rule the cross-validation uses (`trainer.aggregation`,
        `pipeline.evaluation.aggregation`), then 1 - P(no pain); NaN without any face. For a clip model, the rows
        hold window scores: the video's score aggregates its windows'."""
        columns = [f"prob_{name}" for name in self.class_names]
        missing = [column for column in columns if column not in frames.columns]
        if missing:
            raise ValueError(f"video_score needs the frames' class probabilities; missing columns {missing}")
        probs = frames.loc[frames["face_found"].astype(bool), columns].to_numpy(dtype=float)
        if not len(probs):
            return float("nan")
        video = aggregate_class_probabilities(probs, self.aggregation, self.topk)
        return float(self.pain_scores(video[None])[0])
