"""The synthetic BioVid twin: drawn faces that show pain the way PSPI scores it, in BioVid Part A's exact layout.

Every command defaults to this dataset, so the whole pipeline (layout validation, face detection, crops, subject-
grouped folds, training, metrics) runs end to end without the licensed data. It is built to be a fair stand-in:

- The layout is Part A's: ``starting_point/samples.csv`` (TAB-separated) and ``video/<subject>/<sample>.mp4``,
  25 fps, 5.5 s, BioVid-style subject and sample names.
- Two looks (`SyntheticConfig.difficulty`). "classic": upright frontal faces of about half the frame height, drawn
  so that OpenCV's Haar cascade finds them. "hard": faces as real ones challenge a detector: 15-35 % of the frame
  height anywhere in it, head roll up to +-20 degrees and yaw up to +-25 degrees that grow with pain, cluttered
  backgrounds under strong light gradients, eyes that close during pain. The hard look is what tells how often a
  detector loses pain frames.
- Identity varies (face shape, skin, hair, glasses, background, lighting, head position), so a model could learn
  *who* instead of *pain* when folds leak subjects, which is what subject-grouped evaluation must catch.
- Pain follows the Prkachin-Solomon Pain Intensity action units: brow lowering (AU4), orbit tightening (AU6/7),
  nose wrinkle / upper-lip raise (AU9/10) and eye closure (AU43). It grows from PA1 to PA4, starts about 2 s into
  the clip and peaks at 3.5-5 s (the response lags the heat), varies by subject, and a fraction of subjects are
  non-responders, so the task is learnable but not trivial.

Everything is deterministic from the seed: each subject's look comes from (seed, subject) and each video from
(seed, subject, sample), so the result does not depend on the number of workers or on resuming.

Beside every video, `synthetic_regions/<subject>/<sample>.csv` records per frame the action-unit intensities, the head
roll and yaw, and the box (x0, y0, x1, y1, video pixels) of each PSPI region: brows (AU4), orbits (AU6/7), nose and
upper lip (AU9/10), eyes (AU43). With a crop's transform from the frame table (`pipeline.preprocess.video_to_crop`) a
region is found in the crop.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from tqdm import tqdm

from pipeline.biovid import SAMPLES_COLUMNS, SAMPLES_CSV, VIDEO_DIR
from pipeline.io import SettingsMismatch, atomic_path, atomic_write_csv, atomic_write_text
from pipeline.parallel import available_cpus, process_pool
from pipeline.tasks import CLASS_NAMES

SUBJECTS_CSV = "synthetic_subjects.csv"  # ground truth per subject, beside starting_point/ (not part of BioVid)
SAMPLE_TRUTH_CSV = "synthetic_samples.csv"  # ground truth per sample: response intensity and timing
CONFIG_JSON = "synthetic_config.json"  # the config the folder was written with; resuming with another one refuses
REGIONS_DIR = "synthetic_regions"  # per video: action units, pose and PSPI regions per frame (not part of BioVid)
REGIONS = ("brows", "orbits", "nose_lip", "eyes")  # where AU4, AU6/7, AU9/10 and AU43 show
DIFFICULTIES = ("classic", "hard")
# Settings added after twins were first written, with the value those twins were written with.
SETTINGS_BEFORE_RECORDED = {"difficulty": "classic"}

# Seed-sequence stream tags: independent random streams for the roster, each subject's look and each video.
_ROSTER_STREAM, _SUBJECT_STREAM, _VIDEO_STREAM = 101, 202, 303

_SHIFT = 4  # sub-pixel drawing: OpenCV takes coordinates as fixed point with this many fractional bits
_ONE = 1 << _SHIFT


@dataclass(frozen=True)
class SyntheticConfig:
    """Size, look and pain-response knobs of a synthetic twin."""

    n_subjects: int
    samples_per_class: int
    width: int
    height: int
    fps: int = 25
    duration_s: float = 5.5
    seed: int = 0
    non_responder_fraction: float = 0.15
    class_intensity: tuple[float, ...] = (0.0, 0.3, 0.5, 0.75, 1.0)  # mean peak response per class, BL1..PA4
    sample_variability: float = 0.3  # log-normal sigma of a sample's response around its class/subject mean
    missed_response_probability: float = 0.05  # a responder shows (almost) nothing on this share of pain samples
    onset_s: tuple[float, float] = (1.8, 2.6)  # the response starts in this window (uniform)
    peak_s: tuple[float, float] = (3.5, 5.0)  # and reaches its peak in this one
    blink_rate_hz: float = 0.3  # spontaneous blinks, in every class
    noise_sigma: float = 2.0  # sensor noise, grey levels
    render_max_side: int = 480  # frames are drawn at most this large and upscaled (cheap full-resolution output)
    fourcc: str = "mp4v"
    difficulty: str = "classic"  # classic: frontal faces Haar finds | hard: what real faces do to a detector

    def __post_init__(self) -> None:
        if self.n_subjects < 1 or self.samples_per_class < 1:
            raise ValueError("need at least one subject and one sample per class")
        if self.width < 64 or self.height < 48 or self.width % 2 or self.height % 2:
            raise ValueError(f"frame size must be even and at least 64 x 48, got {self.width} x {self.height}")
        if len(self.class_intensity) != len(CLASS_NAMES):
            raise ValueError(f"class_intensity needs one value per class {CLASS_NAMES}")
        if not 0.0 <= self.non_responder_fraction <= 1.0:
            raise ValueError(f"non_responder_fraction must be in [0, 1], got {self.non_responder_fraction}")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {self.difficulty!r}")
        if 5 * self.samples_per_class > 999:
            raise ValueError("sample running numbers have three digits: at most 199 samples per class")

    @property
    def n_frames(self) -> int:
        return math.floor(self.fps * self.duration_s + 0.5)


PRESETS: dict[str, SyntheticConfig] = {
    "tiny": SyntheticConfig(n_subjects=5, samples_per_class=2, width=160, height=120),
    "default": SyntheticConfig(n_subjects=20, samples_per_class=6, width=320, height=240),
    "full": SyntheticConfig(n_subjects=87, samples_per_class=20, width=1388, height=1038),
}


# ----------------------------------------------------------------------------------------------------------- roster
@dataclass(frozen=True)
class Subject:
    """One synthetic participant: BioVid-style name, how they respond to pain, and how they look."""

    subject_id: int
    subject_name: str
    responder: bool
    expressiveness: float  # scales every pain response of this person
    au_weights: tuple[float, float, float, float]  # personal style: AU4, AU6/7, AU9/10, AU43
    skin: tuple[float, float, float]  # BGR
    face_aspect: float  # face half-height / half-width
    face_scale: float  # face half-width as a fraction of the frame height
    head_x: float  # head centre as fractions of the frame
    head_y: float
    hair_style: str
    hair: tuple[float, float, float]
    hairline: float  # hairline height in face half-widths above the face centre
    glasses: bool
    beard: float  # 0 none, else opacity of stubble/beard
    iris: tuple[float, float, float]
    eye_spacing: float
    eye_width: float
    mouth_width: float
    brow_thickness: float
    background: tuple[tuple[float, float, float], tuple[float, float, float]]
    shirt: tuple[float, float, float]
    light_angle: float  # radians, direction the light comes from
    light_strength: float
    # The hard look only (zero in the classic one):
    roll_gain_deg: float = 0.0  # head roll at full pain, degrees (its side is drawn per video)
    yaw_gain_deg: float = 0.0  # head yaw at full pain, degrees
    clutter: int = 0  # seed of the background clutter (0: none)


HAIR_STYLES = ("short", "long", "receding", "bun", "fringe")
HAIR_COLOURS = ((22, 22, 28), (28, 42, 66), (40, 68, 108), (95, 160, 205), (150, 150, 156), (38, 62, 140))
IRIS_COLOURS = ((30, 48, 78), (140, 108, 66), (78, 118, 80), (24, 30, 42))
SKIN_LIGHT, SKIN_DARK = np.array([178.0, 196.0, 232.0]), np.array([62.0, 88.0, 128.0])


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in keys]))


def _subject_names(config: SyntheticConfig) -> list[tuple[str, bool]]:
    """Unique `MMDDYY_sex_age` names and the responder flags (an exact share of non-responders)."""
    rng = _rng(config.seed, _ROSTER_STREAM)
    names: list[str] = []
    while len(names) < config.n_subjects:
        name = (
            f"{rng.integers(1, 13):02d}{rng.integers(1, 29):02d}{rng.integers(9, 17):02d}"
            f"_{'wm'[rng.integers(0, 2)]}_{rng.integers(18, 66)}"
        )
        if name not in names:
            names.append(name)
    n_non = round(config.n_subjects * config.non_responder_fraction)
    non_responders = set(rng.permutation(config.n_subjects)[:n_non].tolist())
    return [(name, index not in non_responders) for index, name in enumerate(names)]


def _luminance(bgr: np.ndarray) -> float:
    return float(np.dot(bgr, (0.114, 0.587, 0.299)))


def _background_colour(rng: np.random.Generator, luminance: float) -> np.ndarray:
    """A random hue at about the given grey level.

    The background is kept at most a little brighter than the face: the detector equalises the grey histogram of the
    whole frame, and a dark face before a bright wall ends up crushed to black, where the cascade no longer finds it
    (a weakness of the classic detector, not something the twin should test).
    """
    colour = rng.uniform(0.3, 1.0, 3)
    colour *= np.clip(luminance, 45, 215) / _luminance(colour)
    return np.clip(colour, 20, 235)


def make_subjects(config: SyntheticConfig) -> list[Subject]:
    """Draw every subject's name, pain response and look from the seed."""
    subjects = []
    for index, (name, responder) in enumerate(_subject_names(config)):
        rng = _rng(config.seed, _SUBJECT_STREAM, index)
        male = name.split("_")[1] == "m"
        skin = SKIN_LIGHT + rng.uniform(0, 1) * (SKIN_DARK - SKIN_LIGHT) + rng.normal(0, 6, 3)
        hair = np.array(HAIR_COLOURS[rng.integers(len(HAIR_COLOURS))]) * rng.uniform(0.85, 1.15)
        style = HAIR_STYLES[rng.choice(5, p=[0.45, 0.05, 0.35, 0.05, 0.1] if male else [0.15, 0.4, 0.0, 0.25, 0.2])]
        back = _background_colour(rng, _luminance(skin) + rng.uniform(-70, 25))
        subjects.append(
            Subject(
                subject_id=index,
                subject_name=name,
                responder=responder,
                expressiveness=float(rng.uniform(0.5, 1.3) if responder else rng.uniform(0.0, 0.08)),
                au_weights=tuple(float(w) for w in rng.uniform(0.6, 1.2, 4)),
                skin=tuple(float(c) for c in np.clip(skin, 30, 245)),
                face_aspect=float(rng.uniform(1.22, 1.42)),
                face_scale=float(rng.uniform(0.165, 0.205)),
                head_x=float(rng.uniform(0.44, 0.56)),
                head_y=float(rng.uniform(0.45, 0.52)),
                hair_style=style,
                hair=tuple(float(c) for c in np.clip(hair, 10, 235)),
                hairline=float(rng.uniform(0.72, 0.9) if style != "receding" else rng.uniform(1.0, 1.15)),
                glasses=bool(rng.uniform() < 0.25),
                beard=float(rng.choice([0.0, 0.25, 0.45], p=[0.55, 0.3, 0.15]) if male else 0.0),
                iris=tuple(float(c) for c in IRIS_COLOURS[rng.integers(len(IRIS_COLOURS))]),
                eye_spacing=float(rng.uniform(0.37, 0.43)),
                eye_width=float(rng.uniform(0.17, 0.2)),
                mouth_width=float(rng.uniform(0.25, 0.32)),
                brow_thickness=float(rng.uniform(0.06, 0.085)),
                background=(
                    tuple(float(c) for c in back),
                    tuple(float(c) for c in np.clip(back + rng.normal(0, 25, 3), 40, 230)),
                ),
                shirt=tuple(float(c) for c in rng.uniform(20, 220, 3)),
                light_angle=float(rng.uniform(0, 2 * math.pi)),
                light_strength=float(rng.uniform(0.08, 0.22)),
            )
        )
    if config.difficulty == "hard":
        subjects = [_hard_look(config, subject) for subject in subjects]
    return subjects


def _hard_look(config: SyntheticConfig, subject: Subject) -> Subject:
    """The hard twin's subject: the classic one's identity with a smaller face anywhere in the frame, any background
    with clutter, strong light, and head movement with pain (its own random stream: the classic draws stay)."""
    rng = _rng(config.seed, _SUBJECT_STREAM, subject.subject_id, 1)
    face_height = rng.uniform(0.15, 0.35)  # of the frame height, forehead to chin
    half_height = face_height / 2
    back = rng.uniform(20, 235, 3)
    back_bottom = np.clip(back + rng.normal(0, 50, 3), 20, 235)
    return dataclasses.replace(
        subject,
        face_scale=float(face_height / (2 * subject.face_aspect)),
        head_x=float(rng.uniform(0.3, 0.7)),
        head_y=float(rng.uniform(max(0.32, half_height + 0.12), min(0.62, 0.9 - 2.6 * half_height))),
        background=(tuple(float(c) for c in back), tuple(float(c) for c in back_bottom)),
        light_strength=float(rng.uniform(0.25, 0.6)),
        roll_gain_deg=float(rng.uniform(6.0, 14.0)),
        yaw_gain_deg=float(rng.uniform(8.0, 18.0)),
        clutter=int(rng.integers(1, 2**31)),
    )


@dataclass(frozen=True)
class Sample:
    """One video: its BioVid names and the pain response it shows."""

    subject_id: int
    class_id: int
    number: int  # the running number in the sample name (presentation order within the subject)
    sample_id: int
    sample_name: str
    intensity: float  # peak response (0 = none)
    onset_s: float
    peak_s: float


def make_samples(config: SyntheticConfig, subjects: list[Subject]) -> list[Sample]:
    """Every subject's samples, running numbers shuffled across classes like a stimulus presentation order."""
    samples = []
    per_subject = len(CLASS_NAMES) * config.samples_per_class
    for subject in subjects:
        numbers = _rng(config.seed, _ROSTER_STREAM, subject.subject_id).permutation(per_subject) + 1
        for slot, number in enumerate(numbers.tolist()):
            class_id = slot // config.samples_per_class
            rng = _rng(config.seed, _VIDEO_STREAM, subject.subject_id, number, 0)
            intensity = config.class_intensity[class_id] * subject.expressiveness
            intensity *= math.exp(rng.normal(0.0, config.sample_variability))
            # both numbers are drawn either way, so the probability does not shift the stream of later draws
            missed, damping = rng.uniform() < config.missed_response_probability, rng.uniform(0.0, 0.3)
            if missed:
                intensity *= damping
            samples.append(
                Sample(
                    subject_id=subject.subject_id,
                    class_id=class_id,
                    number=number,
                    sample_id=0,
                    sample_name=f"{subject.subject_name}-{CLASS_NAMES[class_id]}-{number:03d}",
                    intensity=float(min(intensity, 1.3)),
                    onset_s=float(rng.uniform(*config.onset_s)),
                    peak_s=float(rng.uniform(*config.peak_s)),
                )
            )
    samples.sort(key=lambda s: (s.subject_id, s.class_id, s.number))
    return [dataclasses.replace(sample, sample_id=index) for index, sample in enumerate(samples)]


# ------------------------------------------------------------------------------------------------------- animation
def _smoothstep(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, 0.0, 1.0)
    return x * x * (3 - 2 * x)


def animate(
    config: SyntheticConfig, subject: Subject, sample: Sample, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame action units (AU4, AU6/7, AU9/10, eye closure) in [0, 1] and head pose (dx, dy, roll, scale, yaw).

    Pose offsets are in face half-widths, roll and yaw in radians (yaw 0 in the classic look). The hard look draws
    its extra movement from its own stream, so the classic draws from `rng` are the same in both.
    """
    t = np.arange(config.n_frames) / config.fps
    rise = _smoothstep((t - sample.onset_s) / (sample.peak_s - sample.onset_s))
    decay = 1.0 - 0.25 * _smoothstep((t - sample.peak_s) / 1.5)
    wobble = 1.0 + 0.08 * np.sin(2 * math.pi * rng.uniform(0.4, 1.2) * t + rng.uniform(0, 2 * math.pi))
    pain = sample.intensity * rise * decay * wobble

    def fidget(amplitude: float) -> np.ndarray:  # small spontaneous movement, present in every class
        return (
            amplitude
            * rng.uniform(0, 1)
            * 0.5
            * (1 + np.sin(2 * math.pi * rng.uniform(0.1, 0.5) * t + rng.uniform(0, 2 * math.pi)))
        )

    w4, w67, w910, w43 = subject.au_weights
    au4 = w4 * pain + fidget(0.15)
    au67 = w67 * pain + fidget(0.12)
    au910 = w910 * np.clip((pain - 0.15) / 0.85, 0, None) + fidget(0.06)
    if config.difficulty == "hard":  # eyes squeezed shut earlier in the response
        closure = w43 * np.clip((pain - 0.3) / 0.4, 0, None)
    else:
        closure = w43 * np.clip((pain - 0.55) / 0.45, 0, None)
    n_blinks = rng.poisson(config.blink_rate_hz * config.duration_s)
    for blink_time in rng.uniform(0, config.duration_s, n_blinks):
        closure = np.maximum(closure, 1.0 - np.abs(t - blink_time) / rng.uniform(0.08, 0.14))
    action_units = np.clip(np.stack([au4, au67, au910, closure], axis=1), 0.0, 1.0)

    def drift(amplitude: float) -> np.ndarray:
        out = np.zeros_like(t)
        for _ in range(2):
            out += (
                amplitude
                * rng.normal()
                * np.sin(2 * math.pi * rng.uniform(0.05, 0.45) * t + rng.uniform(0, 2 * math.pi))
            )
        return out

    pose = np.stack(
        [
            rng.normal(0, 0.02) + drift(0.015),
            rng.normal(0, 0.02) + drift(0.015),
            math.radians(rng.normal(0, 1.0)) + drift(math.radians(0.6)),
            1.0 + rng.normal(0, 0.008) + drift(0.006),
            np.zeros_like(t),
        ],
        axis=1,
    )
    if config.difficulty == "hard":
        pose = _hard_pose(config, subject, sample, pose, np.clip(pain, 0.0, 1.0))
    return action_units, pose


def _hard_pose(config: SyntheticConfig, subject: Subject, sample: Sample, pose: np.ndarray,
               pain: np.ndarray) -> np.ndarray:
    """The hard look's head movement: a resting roll and yaw per video, more of both as pain grows (to one side per
    video), and the head pulled down a little; roll within +-20 degrees, yaw within +-25."""
    rng = _rng(config.seed, _VIDEO_STREAM, subject.subject_id, sample.number, 2)
    t = np.arange(config.n_frames) / config.fps
    sway = np.sin(2 * math.pi * rng.uniform(0.1, 0.4) * t + rng.uniform(0, 2 * math.pi))
    roll = rng.normal(0.0, 5.0) + 2.0 * sway + rng.choice([-1.0, 1.0]) * subject.roll_gain_deg * pain
    yaw = rng.normal(0.0, 7.0) + 3.0 * sway + rng.choice([-1.0, 1.0]) * subject.yaw_gain_deg * pain
    pose = pose.copy()
    pose[:, 1] += 0.08 * pain
    pose[:, 2] = np.radians(np.clip(roll, -20.0, 20.0))
    pose[:, 4] = np.radians(np.clip(yaw, -25.0, 25.0))
    return pose


# -------------------------------------------------------------------------------------------------------- drawing
Colour = tuple[float, float, float]


def _mix(colour_a: Colour, colour_b: Colour, weight: float) -> Colour:
    """Colour `weight` of the way from a to b (a flat-colour stand-in for alpha blending)."""
    weight = min(1.0, max(0.0, weight))
    return tuple(a + (b - a) * weight for a, b in zip(colour_a, colour_b, strict=True))


def _scaled(colour: Colour, factor: float) -> Colour:
    return tuple(min(255.0, c * factor) for c in colour)


_UNIT = np.linspace(0.0, 1.0, 9)
_UNIT_BUMP = np.sin(math.pi * _UNIT)
_SYMMETRIC = np.linspace(-1.0, 1.0, 13)
_CIRCLE = np.stack([np.cos(np.linspace(0, 2 * math.pi, 25)[:-1]), np.sin(np.linspace(0, 2 * math.pi, 25)[:-1])], 1)


def _arc(u0: float, u1: float, v: float, bulge: float) -> np.ndarray:
    """Points of a curve from (u0, v) to (u1, v) bent by `bulge` (negative = up) at the middle."""
    return _curve(u0 + (u1 - u0) * _UNIT, v + bulge * _UNIT_BUMP)


def _ellipse_points(
    cu: float, cv: float, au: float, av: float, start_deg: float = 0.0, end_deg: float | None = None, n: int = 17
) -> np.ndarray:
    if end_deg is None:
        return _CIRCLE * (au, av) + (cu, cv)
    angles = np.radians(np.linspace(start_deg, end_deg, n))
    return np.stack([cu + au * np.cos(angles), cv + av * np.sin(angles)], axis=1)


def _curve(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    points = np.empty((len(u), 2))
    points[:, 0], points[:, 1] = u, v
    return points


def _band(u: np.ndarray, top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    """Closed outline of the region between two curves sampled at the same u."""
    n = len(u)
    points = np.empty((2 * n, 2))
    points[:n, 0], points[:n, 1] = u, top
    points[n:, 0], points[n:, 1] = u[::-1], bottom[::-1]
    return points


class _Shapes:
    """Shapes in face-local coordinates, transformed together and drawn in one pass (drawing is per frame, and
    one matrix product for all points is much cheaper than one per shape)."""

    def __init__(self, aspect: float = 1.3) -> None:
        self.items: list[tuple[np.ndarray, Colour, float, bool]] = []
        self.yaw = 0.0  # radians; turns the features about the head's vertical axis (`yawed`)
        self.aspect = aspect

    def fill(self, points: np.ndarray, colour: Colour) -> None:
        self.items.append((points, colour, 0.0, True))

    def line(self, points: np.ndarray, colour: Colour, width: float, closed: bool = False) -> None:
        self.items.append((points, colour, width, closed))

    def ellipse(self, cu: float, cv: float, au: float, av: float, colour: Colour, width: float = 0.0) -> None:
        points = _ellipse_points(cu, cv, au, av)
        if width:
            self.line(points, colour, width, closed=True)
        else:
            self.fill(points, colour)

    def draw(self, image: np.ndarray, linear: np.ndarray, offset: np.ndarray) -> None:
        """Draw everything with local -> pixel map `p = linear @ q + offset`, anti-aliased, sub-pixel."""
        if not self.items:
            return
        pixels_per_unit = math.sqrt(abs(np.linalg.det(linear)))
        points = np.concatenate([item[0] for item in self.items])
        if self.yaw:
            points = yawed(points, self.yaw, self.aspect)
        pixels = np.rint((points @ linear.T + offset) * _ONE).astype(np.int32)
        start = 0
        for shape_points, colour, width, closed in self.items:
            part, start = pixels[start : start + len(shape_points)], start + len(shape_points)
            if width == 0.0:
                cv2.fillPoly(image, [part], colour, cv2.LINE_AA, _SHIFT)
            else:
                cv2.polylines(
                    image, [part], closed, colour, max(1, round(width * pixels_per_unit)), cv2.LINE_AA, _SHIFT
                )
        self.items.clear()


def yawed(points: np.ndarray, yaw: float, aspect: float) -> np.ndarray:
    """Face-local points as seen with the head turned by `yaw` about its vertical axis: each point's depth on a head
    ellipsoid (the nose standing out) moves it sideways, and the face narrows by cos(yaw)."""
    u, v = points[:, 0], points[:, 1]
    depth = 0.75 * np.sqrt(np.clip(1.0 - u**2 - (v / aspect) ** 2, 0.0, None))
    depth += 0.3 * np.exp(-((u / 0.14) ** 2) - ((v - 0.35) / 0.25) ** 2)  # the nose
    out = points.copy()
    out[:, 0] = u * math.cos(yaw) + depth * math.sin(yaw)
    return out


def face_transform(subject: Subject, width: int, height: int, pose: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Face-local -> pixel map (linear part, offset) of a canvas for a pose (dx, dy in half-widths, roll, scale[,
    yaw]: yaw acts on face-local points, `yawed`)."""
    half_width = subject.face_scale * height
    dx, dy, roll, scale = (float(v) for v in pose[:4])
    rotation = scale * np.array([[math.cos(roll), -math.sin(roll)], [math.sin(roll), math.cos(roll)]])
    return half_width * rotation, np.array([subject.head_x * width, subject.head_y * height]) + half_width * np.array(
        [dx, dy])


class FaceRenderer:
    """Draws one subject's frames: a static head layer (background, hair, face shading, lighting) moved by the head
    pose, then the moving features (brows, eyes, wrinkles, mouth, glasses) on top.

    Face-local coordinates: origin at the face centre, unit = face half-width, v pointing down. Only the head's
    region is warped each frame (warping the whole frame costs more than everything else together).
    """

    def __init__(
        self,
        subject: Subject,
        width: int,
        height: int,
        base_pose: np.ndarray,
        noise_sigma: float,
        rng: np.random.Generator,
    ):
        self._place(subject, width, height, base_pose)
        self._draw_layers()
        self.noise = self._noise_pool(noise_sigma, rng)

    def _draw_layers(self) -> None:
        """What every frame starts from, drawn once per clip.

        The static layer is drawn at the clip's first pose; frames only warp it by the (small) motion since then,
        which keeps the seam where the warped head region meets the still background below a pixel or two.
        """
        light = self._light_gain()
        gain = float(light[int(self.centre[1]), int(self.centre[0])])
        self._feature_colours(gain)  # features are drawn over lit skin
        self.shapes = _Shapes()
        self.static = self._static_layer(light)
        b = self.subject.face_aspect
        x0, y0 = self.base_offset + self.half_width * np.array([-1.45, -b - 0.6])
        x1, y1 = self.base_offset + self.half_width * np.array([1.45, b + 1.0])
        self.head_box = (
            max(0, int(x0)),
            max(0, int(y0)),
            min(self.width, int(math.ceil(x1))),
            min(self.height, int(math.ceil(y1))),
        )

    def _place(self, subject: Subject, width: int, height: int, base_pose: np.ndarray) -> None:
        """The frame size, the face's size and centre, and the face-local -> pixel map at `base_pose`."""
        self.subject, self.width, self.height = subject, width, height
        self.half_width = subject.face_scale * height
        self.centre = np.array([subject.head_x * width, subject.head_y * height])
        self.base_linear, self.base_offset = self._pose_transform(base_pose)
        self.base_inverse = np.linalg.inv(self.base_linear)

    def _feature_colours(self, gain: float) -> None:
        """The colours of skin, shadows, brows, lips and glasses, with the light's `gain` at the face centre."""
        subject = self.subject
        self.skin = _scaled(subject.skin, gain)
        self.dark = _scaled(self.skin, 0.45)
        self.brow = _scaled(subject.hair, 0.55 * gain) if sum(subject.hair) < 420 else _scaled(self.skin, 0.42)
        self.lips = _mix(self.skin, (70, 70, 165), 0.35)
        self.glasses = (30.0, 30.0, 35.0) if subject.light_angle < math.pi else (60.0, 75.0, 95.0)

    def _pose_transform(self, pose: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Face-local -> pixel map (linear part, offset) for a pose (dx, dy in half-widths, roll, scale)."""
        return face_transform(self.subject, self.width, self.height, pose)

    def _base_transform(self) -> tuple[np.ndarray, np.ndarray]:
        return self.base_linear, self.base_offset

    # -- the parts that do not move relative to the head
    def _light_gain(self) -> np.ndarray:
        """Multiplicative light from one side, baked into the static layer (head motion is too small to show it)."""
        s = self.subject
        ys, xs = np.mgrid[0 : self.height, 0 : self.width].astype(np.float32)
        along = (xs - self.centre[0]) * math.cos(s.light_angle) + (ys - self.centre[1]) * math.sin(s.light_angle)
        return np.clip(0.97 + s.light_strength * along / (1.5 * self.half_width), 0.55, 1.35)

    def _static_layer(self, light: np.ndarray) -> np.ndarray:
        s, shapes, b = self.subject, self.shapes, self.subject.face_aspect
        skin = s.skin
        ramp = np.linspace(0.0, 1.0, self.height, dtype=np.float32)[:, None, None]
        top, bottom = np.array(s.background[0], np.float32), np.array(s.background[1], np.float32)
        image = np.ascontiguousarray(
            np.broadcast_to(top + ramp * (bottom - top), (self.height, self.width, 3)).astype(np.uint8)
        )
        shapes.ellipse(0.0, b + 1.9, 2.5, 1.3, s.shirt)  # shoulders
        if s.hair_style == "long":
            shapes.fill(np.array([[-1.2, -0.4], [-1.35, b + 1.0], [1.35, b + 1.0], [1.2, -0.4]]), s.hair)
        shapes.fill(np.array([[-0.45, 0.5], [-0.5, b + 0.95], [0.5, b + 0.95], [0.45, 0.5]]), _scaled(skin, 0.78))
        shapes.ellipse(0.0, b + 0.95, 0.5, 0.12, _scaled(skin, 0.78))  # neckline
        if s.hair_style != "long":
            for side in (-1, 1):
                shapes.ellipse(side * 0.98, 0.05, 0.14, 0.27, _scaled(skin, 0.9))  # ears
                shapes.ellipse(side * 0.99, 0.05, 0.07, 0.17, _scaled(skin, 0.75))
        if s.hair_style == "bun":
            shapes.ellipse(0.0, -b - 0.25, 0.4, 0.3, s.hair)
        shapes.ellipse(0.0, -0.12, 1.06, b + 0.12, s.hair)  # hair volume behind the head
        shapes.ellipse(0.0, 0.0, 1.0, b, _scaled(skin, 0.86))  # face, darker towards the rim
        shapes.ellipse(0.0, -0.04, 0.9, b - 0.1, skin)
        for side in (-1, 1):
            shapes.ellipse(side * 0.5, 0.42, 0.2, 0.14, _mix(skin, (90, 90, 200), 0.12))  # cheeks
            shapes.ellipse(side * s.eye_spacing, -0.03, s.eye_width + 0.1, 0.17, _scaled(skin, 0.76))  # sockets
            shapes.ellipse(side * 0.12, 0.22, 0.06, 0.22, _scaled(skin, 0.86))  # sides of the nose
            shapes.ellipse(side * 0.12, 0.5, 0.075, 0.06, _scaled(skin, 0.88))  # nose wings
        shapes.ellipse(0.0, 0.1, 0.06, 0.34, _scaled(skin, 1.1))  # nose bridge highlight
        shapes.ellipse(0.0, 0.47, 0.11, 0.085, _scaled(skin, 1.06))  # nose tip
        shapes.ellipse(0.0, 0.99, 0.22, 0.07, _scaled(skin, 0.9))  # under the lower lip
        shapes.draw(image, *self._base_transform())
        image = cv2.GaussianBlur(image, (0, 0), max(0.6, 0.03 * self.half_width))
        shapes.fill(self._hair_cap(), s.hair)
        shapes.draw(image, *self._base_transform())
        if s.beard > 0:
            beard = image.copy()
            u = np.linspace(-0.96, 0.96, 13)
            top_edge = np.stack([u, 0.1 + 0.5 * (1 - (u / 0.96) ** 2)], axis=1)  # sideburns to under the nose
            shapes.fill(np.concatenate([top_edge, _ellipse_points(0.0, 0.0, 0.97, b, 5, 175)]), s.hair)
            shapes.draw(beard, *self._base_transform())
            image = cv2.addWeighted(beard, s.beard, image, 1 - s.beard, 0)
        image = cv2.GaussianBlur(image, (0, 0), max(0.5, 0.015 * self.half_width))
        lit = image.astype(np.float32) * light[..., None]
        return np.clip(lit, 0, 255).astype(np.uint8)

    def _hair_cap(self) -> np.ndarray:
        s, b = self.subject, self.subject.face_aspect
        outline = _ellipse_points(0.0, -0.08, 1.04, b + 0.1, 190, 350, 25)  # over the top of the head
        u = np.linspace(0.98, -0.98, 21)
        receding = s.hair_style == "receding"
        temple = -0.45 if receding else -0.25
        hairline = -s.hairline + (temple + s.hairline) * np.abs(u) ** (0.7 if receding else 1.6)
        if s.hair_style == "fringe":  # swept to one side, but above the brows
            hairline = np.minimum(hairline + 0.2 * (1 - (u + 1) / 2), -0.62)
        return np.concatenate([outline, np.stack([u, hairline], axis=1)])

    def _noise_pool(self, sigma: float, rng: np.random.Generator, size: int = 3) -> list[tuple[np.ndarray, ...]]:
        """A few grey noise images (as positive and negative parts, so uint8 saturating adds apply them)."""
        pool = []
        for _ in range(size):
            noise = np.repeat(rng.normal(0.0, sigma, (self.height, self.width, 1)).astype(np.float32), 3, axis=2)
            pool.append((np.clip(noise, 0, 255).astype(np.uint8), np.clip(-noise, 0, 255).astype(np.uint8)))
        return pool

    # -- the parts that move
    def render(self, action_units: np.ndarray, pose: np.ndarray, noise_index: int) -> np.ndarray:
        """One frame for the given action units (AU4, AU6/7, AU9/10, closure) and pose (dx, dy, roll, scale)."""
        linear, offset = self._pose_transform(pose)
        # Move the head region of the static layer by the motion since the base pose: p -> M (p - c0) + c1.
        motion = linear @ self.base_inverse
        x0, y0, x1, y1 = self.head_box
        corner = np.array([x0, y0], dtype=float)
        shift = motion @ (corner - self.base_offset) + offset - corner
        frame = self.static.copy()
        frame[y0:y1, x0:x1] = cv2.warpAffine(
            self.static[y0:y1, x0:x1],
            np.hstack([motion, shift[:, None]]),
            (x1 - x0, y1 - y0),
            flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_REPLICATE,
        )
        self._features(action_units)
        self.shapes.draw(frame, linear, offset)
        positive, negative = self.noise[noise_index % len(self.noise)]
        return cv2.subtract(cv2.add(frame, positive), negative)

    def _features(self, action_units: np.ndarray) -> None:
        """Queue the moving features for a frame's action units (AU4, AU6/7, AU9/10, eye closure)."""
        au4, au67, au910, closure = (float(v) for v in action_units)
        self._brows(au4)
        for side in (-1, 1):
            self._eye(side, au67, closure)
        self._wrinkles(au4, au67, au910)
        self._mouth(au910)
        if self.subject.glasses:
            self._glasses()

    def _brows(self, au4: float) -> None:
        s = self.subject
        inner = np.array([0.13 - 0.05 * au4, -0.3 + 0.13 * au4])
        outer = np.array([0.66, -0.33 + 0.04 * au4])
        centre = inner + _UNIT[:, None] * (outer - inner)
        centre[:, 1] -= (0.07 - 0.05 * au4) * np.sin(math.pi * np.minimum(1.0, _UNIT * 1.3))
        half = s.brow_thickness * (1.15 - 0.55 * _UNIT) / 2
        outline = _band(centre[:, 0], centre[:, 1] - half, centre[:, 1] + half)
        for side in (-1, 1):
            self.shapes.fill(outline * (side, 1), self.brow)

    def _eye(self, side: int, au67: float, closure: float) -> None:
        s = self.subject
        u0, v0 = side * s.eye_spacing, -0.02 + 0.015 * closure - 0.01 * au67
        width = s.eye_width * (1 - 0.06 * au67)
        opening = 1.0 - closure
        upper_height = 0.095 * (1 - 0.3 * au67) * opening
        lower_height = 0.055 * (1 - 0.7 * au67) * opening
        u = u0 + width * _SYMMETRIC
        shape = 1 - _SYMMETRIC**2
        upper = v0 - upper_height * shape**0.8
        lower = v0 + lower_height * shape
        if opening > 0.08:
            self.shapes.fill(_band(u, upper, lower), (225.0, 230.0, 235.0))
            iris_u, iris_v = u0 + 0.02 * side, v0 - 0.01
            for radius, colour in ((0.08, s.iris), (0.036, (15.0, 15.0, 15.0))):
                # The iris disc clipped to the open eye: between the lids, column by column.
                ui = iris_u + radius * _SYMMETRIC
                half = radius * np.sqrt(shape)
                xn = np.clip((ui - u0) / width, -1.0, 1.0)
                top = np.maximum(iris_v - half, v0 - upper_height * (1 - xn**2) ** 0.8)
                bottom = np.maximum(top, np.minimum(iris_v + half, v0 + lower_height * (1 - xn**2)))
                self.shapes.fill(_band(ui, top, bottom), colour)
        self.shapes.line(_curve(u, upper), self.dark, 0.035)  # lash line: stays dark when the eye closes
        self.shapes.line(_curve(u, lower), _scaled(self.skin, 0.65), 0.015)
        crease = _arc(u0 - width * 0.9, u0 + width * 0.9, v0 - 0.12 + 0.03 * au67 + 0.02 * closure, -0.04)
        self.shapes.line(crease, _scaled(self.skin, 0.6), 0.02)

    def _wrinkles(self, au4: float, au67: float, au910: float) -> None:
        s, shapes = self.subject, self.shapes
        if au4 > 0.1:  # vertical furrows between the lowered brows
            for side in (-1, 1):
                shapes.line(
                    np.array([[side * 0.05, -0.32], [side * 0.06, -0.15]]), _mix(self.skin, self.dark, 0.7 * au4), 0.02
                )
        if au67 > 0.1:  # raised cheeks: a furrow under the lower lid
            for side in (-1, 1):
                u0 = side * s.eye_spacing
                shapes.line(
                    _arc(u0 - 0.17, u0 + 0.17, 0.12 - 0.02 * au67, 0.05), _mix(self.skin, self.dark, 0.6 * au67), 0.02
                )
        if au910 > 0.1:  # nose wrinkle
            for v in (-0.06, 0.0, 0.06):
                shapes.line(_arc(-0.08, 0.08, v, -0.02), _mix(self.skin, self.dark, 0.6 * au910), 0.015)
        for side in (-1, 1):  # nasolabial folds, deepened by the raised upper lip
            fold = np.array([[0.17 * side, 0.47], [0.26 * side, 0.62], [0.33 * side, 0.78], [0.36 * side, 0.92]])
            fold[:, 1] -= 0.04 * au910
            shapes.line(fold, _mix(self.skin, self.dark, 0.2 + 0.5 * au910), 0.02)
            shapes.ellipse(
                side * 0.07, 0.53 - 0.03 * au910, 0.035 * (1 + 0.4 * au910), 0.018, (35.0, 35.0, 45.0)
            )  # nostril

    def _mouth(self, au910: float) -> None:
        s, shapes = self.subject, self.shapes
        centre, x = 0.82, _SYMMETRIC
        shape = 1 - x**2
        u = s.mouth_width * (1 + 0.1 * au910) * x
        lift = 0.07 * au910  # upper-lip raise opens the mouth
        upper_bottom = centre - lift * shape
        upper_top = upper_bottom - 0.045 * np.sqrt(shape) - 0.008 * shape - 0.012 * np.cos(2 * math.pi * x) * shape
        lower_top = centre + 0.01 * au910 * shape
        lower_bottom = lower_top + 0.065 * np.sqrt(shape)
        if lift > 0.004:
            shapes.fill(_band(u, upper_bottom, lower_top), (40.0, 30.0, 55.0))
            shapes.fill(_band(u * 0.8, upper_bottom, upper_bottom + 0.6 * lift * shape), (215.0, 220.0, 225.0))
        shapes.fill(_band(u, upper_top, upper_bottom), _scaled(self.lips, 0.92))
        shapes.fill(_band(u, lower_top, lower_bottom), self.lips)
        shapes.line(_curve(u, upper_bottom), _scaled(self.lips, 0.55), 0.015)

    def _glasses(self) -> None:
        s, shapes = self.subject, self.shapes
        rim = s.eye_width + 0.09
        for side in (-1, 1):
            shapes.ellipse(side * s.eye_spacing, 0.0, rim, 0.15, self.glasses, width=0.03)
            shapes.line(np.array([[side * (s.eye_spacing + rim), -0.02], [side * 0.98, -0.05]]), self.glasses, 0.03)
        inner = s.eye_spacing - rim
        shapes.line(_arc(-inner, inner, -0.03, -0.03), self.glasses, 0.03)


class HardFaceRenderer(FaceRenderer):
    """The hard look: a head layer composited over a cluttered background, so the head can roll by +-20 degrees
    without a seam; yaw moves the features (nose and eye sockets included) sideways; a strong light gradient across
    the whole frame is applied last, so it stays in the scene while the head moves."""

    def _draw_layers(self) -> None:
        """The background, the head layer with its alpha, and the frame's light, drawn once per clip."""
        self._feature_colours(1.0)  # unlit: the light is applied to the finished frame
        self.shapes = _Shapes(self.subject.face_aspect)
        self.background = self._background_layer()
        self.head, self.alpha = self._head_layer()
        self.light = self._frame_light()
        self.lit_background = np.clip(self.background * self.light, 0, 255).astype(np.uint8)
        rows, columns = np.nonzero(self.alpha > 0.004)
        self.head_corners = np.array([[columns.min(), rows.min()], [columns.max() + 1, rows.min()],
                                      [columns.min(), rows.max() + 1], [columns.max() + 1, rows.max() + 1]], float)

    def _frame_light(self) -> np.ndarray:
        """A gradient across the whole frame (about 0.4x to 1.6x from one side to the other)."""
        s = self.subject
        ys, xs = np.mgrid[0 : self.height, 0 : self.width].astype(np.float32)
        along = (xs - self.width / 2) * math.cos(s.light_angle) + (ys - self.height / 2) * math.sin(s.light_angle)
        gain = 1.0 + s.light_strength * along / (0.5 * math.hypot(self.width, self.height))
        return np.clip(gain, 0.35, 1.7)[..., None]

    def _background_layer(self) -> np.ndarray:
        """The wall (a colour gradient) with clutter (shelves, frames, posters, cables), then the shoulders and neck."""
        s, b = self.subject, self.subject.face_aspect
        ramp = np.linspace(0.0, 1.0, self.height, dtype=np.float32)[:, None, None]
        top, bottom = np.array(s.background[0], np.float32), np.array(s.background[1], np.float32)
        image = np.ascontiguousarray(
            np.broadcast_to(top + ramp * (bottom - top), (self.height, self.width, 3)).astype(np.uint8)
        )
        rng = np.random.default_rng(s.clutter)
        scale = max(self.width, self.height)
        for _ in range(int(rng.integers(8, 20))):
            colour = tuple(float(c) for c in rng.uniform(15, 240, 3))
            x, y = rng.uniform(-0.1, 1.1) * self.width, rng.uniform(-0.1, 1.1) * self.height
            w, h = rng.uniform(0.03, 0.35) * scale, rng.uniform(0.03, 0.35) * scale
            kind = rng.integers(0, 4)
            if kind == 0:  # a filled box: a shelf, a cabinet, a poster
                cv2.rectangle(image, (int(x), int(y)), (int(x + w), int(y + h)), colour, -1, cv2.LINE_AA)
            elif kind == 1:  # a frame
                cv2.rectangle(image, (int(x), int(y)), (int(x + w), int(y + h)), colour,
                              max(1, int(rng.uniform(0.004, 0.015) * scale)), cv2.LINE_AA)
            elif kind == 2:  # a round thing: a clock, a lamp
                cv2.ellipse(image, (int(x), int(y)), (int(w / 3), int(h / 3)), 0, 0, 360, colour, -1, cv2.LINE_AA)
            else:  # a cable, an edge
                cv2.line(image, (int(x), int(y)), (int(x + rng.normal(0, w)), int(y + rng.normal(0, h))), colour,
                         max(1, int(rng.uniform(0.002, 0.01) * scale)), cv2.LINE_AA)
        shapes = self.shapes
        shapes.ellipse(0.0, b + 1.9, 2.5, 1.3, s.shirt)  # shoulders
        shapes.fill(np.array([[-0.45, 0.5], [-0.5, b + 0.95], [0.5, b + 0.95], [0.45, 0.5]]), _scaled(self.skin, 0.78))
        shapes.ellipse(0.0, b + 0.95, 0.5, 0.12, _scaled(self.skin, 0.78))  # neckline
        shapes.draw(image, self.base_linear, self.base_offset)
        return cv2.GaussianBlur(image, (0, 0), max(0.5, 0.01 * self.half_width))

    def _head_layer(self) -> tuple[np.ndarray, np.ndarray]:
        """The head (hair, ears, face) at the base pose, and its coverage (alpha, 0..1)."""
        s, shapes, b, skin = self.subject, self.shapes, self.subject.face_aspect, self.skin
        image = np.zeros((self.height, self.width, 3), np.uint8)
        mask = np.zeros((self.height, self.width), np.uint8)
        outline = []
        if s.hair_style == "long":
            outline.append(np.array([[-1.2, -0.4], [-1.35, b + 1.0], [1.35, b + 1.0], [1.2, -0.4]]))
            shapes.fill(outline[-1], s.hair)
        if s.hair_style != "long":
            for side in (-1, 1):
                shapes.ellipse(side * 0.98, 0.05, 0.14, 0.27, _scaled(skin, 0.9))  # ears
                shapes.ellipse(side * 0.99, 0.05, 0.07, 0.17, _scaled(skin, 0.75))
                outline.append(_ellipse_points(side * 0.98, 0.05, 0.14, 0.27))
        if s.hair_style == "bun":
            shapes.ellipse(0.0, -b - 0.25, 0.4, 0.3, s.hair)
            outline.append(_ellipse_points(0.0, -b - 0.25, 0.4, 0.3))
        shapes.ellipse(0.0, -0.12, 1.06, b + 0.12, s.hair)  # hair volume behind the head
        outline.append(_ellipse_points(0.0, -0.12, 1.06, b + 0.12))
        shapes.ellipse(0.0, 0.0, 1.0, b, _scaled(skin, 0.86))  # face, darker towards the rim
        shapes.ellipse(0.0, -0.04, 0.9, b - 0.1, skin)
        outline.append(_ellipse_points(0.0, 0.0, 1.0, b))
        shapes.draw(image, self.base_linear, self.base_offset)
        image = cv2.GaussianBlur(image, (0, 0), max(0.6, 0.03 * self.half_width))
        shapes.fill(self._hair_cap(), s.hair)
        outline.append(self._hair_cap())
        shapes.draw(image, self.base_linear, self.base_offset)
        if s.beard > 0:
            beard = image.copy()
            u = np.linspace(-0.96, 0.96, 13)
            top_edge = np.stack([u, 0.1 + 0.5 * (1 - (u / 0.96) ** 2)], axis=1)
            shapes.fill(np.concatenate([top_edge, _ellipse_points(0.0, 0.0, 0.97, b, 5, 175)]), s.hair)
            shapes.draw(beard, self.base_linear, self.base_offset)
            image = cv2.addWeighted(beard, s.beard, image, 1 - s.beard, 0)
        for points in outline:
            shapes.fill(points, (255.0, 255.0, 255.0))
        shapes.draw(mask, self.base_linear, self.base_offset)
        alpha = cv2.GaussianBlur(mask.astype(np.float32) / 255.0, (0, 0), max(0.5, 0.015 * self.half_width))
        return cv2.GaussianBlur(image, (0, 0), max(0.5, 0.015 * self.half_width)), alpha

    def _shading(self) -> None:
        """Eye sockets and the nose, drawn with the features so that they follow the yaw."""
        s, shapes, skin = self.subject, self.shapes, self.skin
        for side in (-1, 1):
            shapes.ellipse(side * s.eye_spacing, -0.03, s.eye_width + 0.1, 0.17, _scaled(skin, 0.8))  # sockets
            shapes.ellipse(side * 0.12, 0.22, 0.06, 0.22, _scaled(skin, 0.86))  # sides of the nose
            shapes.ellipse(side * 0.12, 0.5, 0.075, 0.06, _scaled(skin, 0.88))  # nose wings
        shapes.ellipse(0.0, 0.1, 0.06, 0.34, _scaled(skin, 1.1))  # nose bridge highlight
        shapes.ellipse(0.0, 0.47, 0.11, 0.085, _scaled(skin, 1.06))  # nose tip

    def render(self, action_units: np.ndarray, pose: np.ndarray, noise_index: int) -> np.ndarray:
        linear, offset = self._pose_transform(pose)
        motion = linear @ self.base_inverse
        warp = np.hstack([motion, (offset - motion @ self.base_offset)[:, None]])
        # Only the head's box changes from frame to frame: composite, draw and light there.
        corners = self.head_corners @ motion.T + warp[:, 2]
        x0, y0 = (max(0, int(v) - 2) for v in corners.min(0))
        x1, y1 = min(self.width, int(corners[:, 0].max()) + 3), min(self.height, int(corners[:, 1].max()) + 3)
        warp[:, 2] -= (x0, y0)
        size = (x1 - x0, y1 - y0)
        head = cv2.warpAffine(self.head, warp, size, flags=cv2.INTER_LINEAR)
        alpha = cv2.warpAffine(self.alpha, warp, size, flags=cv2.INTER_LINEAR)[..., None]
        region = (self.background[y0:y1, x0:x1] * (1.0 - alpha) + head * alpha).astype(np.uint8)
        self.shapes.yaw = float(pose[4])
        self._shading()
        self._features(action_units)
        self.shapes.draw(region, linear, offset - (x0, y0))
        self.shapes.yaw = 0.0
        frame = self.lit_background.copy()
        frame[y0:y1, x0:x1] = np.clip(region * self.light[y0:y1, x0:x1], 0, 255).astype(np.uint8)
        positive, negative = self.noise[noise_index % len(self.noise)]
        return cv2.subtract(cv2.add(frame, positive), negative)


# --------------------------------------------------------------------------------------------------------- videos
def canvas_size(config: SyntheticConfig) -> tuple[int, int]:
    """The size frames are drawn at: the output size, or smaller (then upscaled) past `render_max_side`."""
    scale = min(1.0, config.render_max_side / max(config.width, config.height))
    return max(64, round(config.width * scale)), max(48, round(config.height * scale))


def render_frames(config: SyntheticConfig, subject: Subject, sample: Sample) -> Iterator[np.ndarray]:
    """The video's frames at the output size, deterministic from (seed, subject, sample)."""
    rng = _rng(config.seed, _VIDEO_STREAM, subject.subject_id, sample.number, 1)
    action_units, pose = animate(config, subject, sample, rng)
    width, height = canvas_size(config)
    renderer_class = HardFaceRenderer if config.difficulty == "hard" else FaceRenderer
    renderer = renderer_class(subject, width, height, pose[0], config.noise_sigma, rng)
    noise_order = rng.integers(0, len(renderer.noise), config.n_frames)
    for index in range(config.n_frames):
        frame = renderer.render(action_units[index], pose[index], int(noise_order[index]))
        if (width, height) != (config.width, config.height):
            frame = cv2.resize(frame, (config.width, config.height), interpolation=cv2.INTER_LINEAR)
        yield frame


def video_is_complete(path: Path, config: SyntheticConfig) -> bool:
    """A finished video: opens, and has the configured size and frame count."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    capture = cv2.VideoCapture(str(path))
    try:
        return (
            capture.isOpened()
            and int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == config.n_frames
            and int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)) == config.width
            and int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)) == config.height
        )
    finally:
        capture.release()


def write_video(path: Path, config: SyntheticConfig, subject: Subject, sample: Sample) -> None:
    """Render and encode one video atomically (a temp .mp4 beside it, renamed when complete)."""
    for stale in path.parent.glob(f".{path.stem}.*{path.suffix}"):  # left by a killed run
        stale.unlink(missing_ok=True)
    with atomic_path(path) as tmp:
        writer = cv2.VideoWriter(
            str(tmp), cv2.VideoWriter.fourcc(*config.fourcc), config.fps, (config.width, config.height)
        )
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV cannot write {config.fourcc} video to {tmp}")
        try:
            for frame in render_frames(config, subject, sample):
                writer.write(frame)
        finally:
            writer.release()


def _region_outlines(subject: Subject) -> dict[str, np.ndarray]:
    """Each PSPI region as an outline in face-local coordinates, covering the feature over its whole range of
    motion (brows lowered, cheeks raised, lip raised)."""
    reach = subject.eye_spacing + subject.eye_width
    rectangles = {
        "brows": (-0.75, -0.5, 0.75, -0.12),  # AU4: brow lowering, the furrows between the brows
        "orbits": (-(reach + 0.12), -0.22, reach + 0.12, 0.2),  # AU6/7: orbit tightening, the cheek furrows
        "nose_lip": (-0.32, -0.1, 0.32, 0.9),  # AU9/10: nose wrinkle, upper-lip raise
        "eyes": (-reach, -0.12, reach, 0.08),  # AU43: eye closure
    }
    edge = np.linspace(0.0, 1.0, 5)
    outlines = {}
    for name, (u0, v0, u1, v1) in rectangles.items():
        u, v = u0 + (u1 - u0) * edge, v0 + (v1 - v0) * edge
        outlines[name] = np.concatenate([np.stack([u, np.full(5, v0)], 1), np.stack([u, np.full(5, v1)], 1),
                                         np.stack([np.full(5, u0), v], 1), np.stack([np.full(5, u1), v], 1)])
    return outlines


def face_regions(config: SyntheticConfig, subject: Subject, sample: Sample) -> pd.DataFrame:
    """Per frame of the video: the action units, head roll and yaw, and each PSPI region's box in video pixels
    (`<region>_x0, _y0, _x1, _y1`), computed from the same animation the video is rendered from."""
    rng = _rng(config.seed, _VIDEO_STREAM, subject.subject_id, sample.number, 1)
    action_units, pose = animate(config, subject, sample, rng)
    width, height = canvas_size(config)
    upscale = np.array([config.width / width, config.height / height])
    outlines = _region_outlines(subject)
    rows = []
    for index in range(config.n_frames):
        linear, offset = face_transform(subject, width, height, pose[index])
        row: dict[str, float] = {"frame_index": index, "time_s": round(index / config.fps, 4)}
        row |= dict(zip(("au4", "au6_7", "au9_10", "au43"), np.round(action_units[index], 4).tolist(), strict=True))
        row |= {"roll_deg": round(math.degrees(pose[index, 2]), 3), "yaw_deg": round(math.degrees(pose[index, 4]), 3)}
        for name, outline in outlines.items():
            local = yawed(outline, float(pose[index, 4]), subject.face_aspect) if pose[index, 4] else outline
            pixels = (local @ linear.T + offset + 0.5) * upscale - 0.5  # canvas -> video pixels (resize's centres)
            (x0, y0), (x1, y1) = pixels.min(0), pixels.max(0)
            row |= {f"{name}_x0": x0, f"{name}_y0": y0, f"{name}_x1": x1, f"{name}_y1": y1}
        rows.append(row)
    return pd.DataFrame(rows).round(2)


def regions_path(root: Path, subject_name: str, sample_name: str) -> Path:
    """Where a video's per-frame action units and PSPI regions are: beside starting_point/, not inside video/."""
    return Path(root) / REGIONS_DIR / subject_name / f"{sample_name}.csv"


def _write_video_job(job: tuple[Path, Path, SyntheticConfig, Subject, Sample, bool]) -> str:
    """Write a sample's regions table, and its video unless `video_done`."""
    video, regions, config, subject, sample, video_done = job
    if not video_done:
        write_video(video, config, subject, sample)
    if not regions.is_file():
        atomic_write_csv(regions, face_regions(config, subject, sample))
    return sample.sample_name


def _init_worker() -> None:
    cv2.setNumThreads(1)  # one process per core already; OpenCV's own threads would only compete


def samples_table(subjects: list[Subject], samples: list[Sample]) -> pd.DataFrame:
    """The samples.csv rows, in BioVid's column order."""
    names = {s.subject_id: s.subject_name for s in subjects}
    return pd.DataFrame(
        [
            (s.subject_id, names[s.subject_id], s.class_id, CLASS_NAMES[s.class_id], s.sample_id, s.sample_name)
            for s in samples
        ],
        columns=list(SAMPLES_COLUMNS),
    )


def _subjects_table(subjects: list[Subject]) -> pd.DataFrame:
    rows = []
    for subject in subjects:
        row = dataclasses.asdict(subject)
        for key in ("au_weights", "skin", "hair", "iris", "background", "shirt"):
            row[key] = json.dumps(np.round(np.array(row[key], dtype=float), 2).tolist())
        rows.append(row)
    return pd.DataFrame(rows).round(4)


def _truth_table(subjects: list[Subject], samples: list[Sample]) -> pd.DataFrame:
    names = {s.subject_id: s.subject_name for s in subjects}
    return pd.DataFrame(
        [
            (names[s.subject_id], s.sample_name, CLASS_NAMES[s.class_id], s.intensity, s.onset_s, s.peak_s)
            for s in samples
        ],
        columns=["subject_name", "sample_name", "class_name", "intensity", "onset_s", "peak_s"],
    ).round(4)


def _write_if_changed(path: Path, text: str) -> None:
    """Atomic write that leaves an identical file alone (a resumed run rewrites nothing)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    atomic_write_text(path, text)


def _check_config(root: Path, config: SyntheticConfig) -> str:
    """The config as JSON; refuses a folder written with another config, or one that is not a synthetic twin."""
    text = json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True) + "\n"
    path = root / CONFIG_JSON
    found = SETTINGS_BEFORE_RECORDED | json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    if not path.is_file() and ((root / SAMPLES_CSV).exists() or (root / VIDEO_DIR).exists()):
        raise ValueError(
            f"{root} holds a dataset but no {CONFIG_JSON}: not a synthetic twin (the real BioVid?), "
            f"refusing to write into it"
        )
    asked = json.loads(text)
    if found is not None and found != asked:
        changed = "; ".join(f"{key}: {found.get(key)!r} -> {asked.get(key)!r}"
                            for key in sorted(set(found) | set(asked)) if found.get(key) != asked.get(key))
        raise SettingsMismatch(
            f"{path} was written with other synthetic settings ({changed}). Delete this twin and its crops "
            f"(`make clean-data` deletes all of data/; or remove {root} and its processed folder), or generate "
            f"into other folders (data.root=... data.processed_dir=... data.manifest_dir=...)"
        )
    return text


def generate(root: Path, config: SyntheticConfig, workers: int | None = None, progress: bool = True) -> pd.DataFrame:
    """Write the synthetic twin into `root` in BioVid Part A's layout and return its samples table.

    Resumable: videos already complete on disk are kept, and samples.csv is written last, so its presence means the
    dataset is complete. Also writes ground truth (synthetic_subjects.csv, synthetic_samples.csv, and per video the
    action units and PSPI regions of every frame under synthetic_regions/) and the config beside starting_point/.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config_text = _check_config(root, config)
    _write_if_changed(root / CONFIG_JSON, config_text)
    subjects = make_subjects(config)
    samples = make_samples(config, subjects)
    by_id = {s.subject_id: s for s in subjects}
    jobs = []
    for sample in samples:
        subject = by_id[sample.subject_id]
        path = root / VIDEO_DIR / subject.subject_name / f"{sample.sample_name}.mp4"
        regions = regions_path(root, subject.subject_name, sample.sample_name)
        video_done = video_is_complete(path, config)
        if not video_done or not regions.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            jobs.append((path, regions, config, subject, sample, video_done))
    workers = min(workers or available_cpus(), max(1, len(jobs)))
    with tqdm(total=len(jobs), desc="synthetic videos", unit="video", disable=not progress) as bar:
        if workers == 1:
            for job in jobs:
                _write_video_job(job)
                bar.update()
        else:
            with process_pool(workers, _init_worker) as pool:
                for _ in pool.imap_unordered(_write_video_job, jobs):
                    bar.update()
    _write_if_changed(root / SUBJECTS_CSV, _subjects_table(subjects).to_csv(index=False))
    _write_if_changed(root / SAMPLE_TRUTH_CSV, _truth_table(subjects, samples).to_csv(index=False))
    table = samples_table(subjects, samples)
    _write_if_changed(root / SAMPLES_CSV, table.to_csv(sep="\t", index=False))
    return table
