"""Who is in the twin and what each video shows: the subjects (name, pain response, look) and their samples
(class, running number, response intensity and timing), all drawn from the seed."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pipeline.data.biovid import NON_RESPONDERS
from pipeline.data.biovid_folds import biovid_subjects
from pipeline.data.synthetic.settings import (
    BURST_PART,
    ROSTER_STREAM,
    SUBJECT_STREAM,
    VIDEO_STREAM,
    SyntheticConfig,
    seeded_rng,
)
from pipeline.data.tasks import CLASS_NAMES


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
    resting_au: tuple[float, float] = (0.0, 0.0)  # the person baseline: resting AU4 and AU6/7 in every video


HAIR_STYLES = ("short", "long", "receding", "bun", "fringe")
HAIR_COLOURS = ((22, 22, 28), (28, 42, 66), (40, 68, 108), (95, 160, 205), (150, 150, 156), (38, 62, 140))
IRIS_COLOURS = ((30, 48, 78), (140, 108, 66), (78, 118, 80), (24, 30, 42))
SKIN_LIGHT, SKIN_DARK = np.array([178.0, 196.0, 232.0]), np.array([62.0, 88.0, 128.0])


def _subject_names(config: SyntheticConfig) -> list[tuple[str, bool]]:
    """Unique `MMDDYY_sex_age` names and the responder flags: drawn (an exact share of non-responders), or Part A's
    87 people in name order with its 20 non-responders (`roster: biovid`), so that BioVid's fold files apply."""
    if config.roster == "biovid":
        return [(name, name not in NON_RESPONDERS) for name in biovid_subjects("all87")]
    rng = seeded_rng(config.seed, ROSTER_STREAM)
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
        rng = seeded_rng(config.seed, SUBJECT_STREAM, index)
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
    if config.resting_au_sd > 0:  # its own stream: the other draws stay as they were
        subjects = [dataclasses.replace(subject, resting_au=tuple(float(v) for v in np.abs(seeded_rng(
            config.seed, SUBJECT_STREAM, subject.subject_id, 2).normal(0.0, config.resting_au_sd, 2))))
            for subject in subjects]
    return subjects


def _hard_look(config: SyntheticConfig, subject: Subject) -> Subject:
    """The hard twin's subject: the classic one's identity with a smaller face anywhere in the frame, any background
    with clutter, strong light, and head movement with pain (its own random stream: the classic draws stay)."""
    rng = seeded_rng(config.seed, SUBJECT_STREAM, subject.subject_id, 1)
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
    burst_start_s: float = -1.0  # the temporal cue's burst starts here (-1: the twin plants none)
    burst_locked: bool = False  # the burst is the stimulus-locked one of a responder's pain video


def make_samples(config: SyntheticConfig, subjects: list[Subject]) -> list[Sample]:
    """Every subject's samples, running numbers shuffled across classes like a stimulus presentation order."""
    samples = []
    per_subject = len(CLASS_NAMES) * config.samples_per_class
    for subject in subjects:
        numbers = seeded_rng(config.seed, ROSTER_STREAM, subject.subject_id).permutation(per_subject) + 1
        for slot, number in enumerate(numbers.tolist()):
            class_id = slot // config.samples_per_class
            rng = seeded_rng(config.seed, VIDEO_STREAM, subject.subject_id, number, 0)
            intensity = config.class_intensity[class_id] * subject.expressiveness
            intensity *= math.exp(rng.normal(0.0, config.sample_variability))
            # both numbers are drawn either way, so the probability does not shift the stream of later draws
            missed, damping = rng.uniform() < _miss_probability(config, class_id), rng.uniform(0.0, 0.3)
            if missed:  # a trace of a response; none at all where the share is set per class
                intensity *= damping if config.response_probability is None else 0.0
            locked = class_id > 0 and subject.responder and not missed
            burst_start = _burst_start(config, subject.subject_id, number, locked)
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
                    burst_start_s=burst_start,
                    burst_locked=locked and burst_start >= 0,
                )
            )
    samples.sort(key=lambda s: (s.subject_id, s.class_id, s.number))
    return [dataclasses.replace(sample, sample_id=index) for index, sample in enumerate(samples)]


def _miss_probability(config: SyntheticConfig, class_id: int) -> float:
    """The share of a responder's clips of this class that show (almost) nothing."""
    if config.response_probability is None:
        return config.missed_response_probability
    return 1.0 - config.response_probability[class_id]


def _burst_start(config: SyntheticConfig, subject_id: int, number: int, locked: bool) -> float:
    """When the temporal cue's burst starts in this video: within the pain window when `locked` (a responder's pain
    video that shows a response), else anywhere in the rest window; -1 where the twin plants no burst."""
    if config.burst_amplitude <= 0:
        return -1.0
    window = config.burst_pain_window_s if locked else config.burst_rest_window_s
    return float(seeded_rng(config.seed, VIDEO_STREAM, subject_id, number, BURST_PART).uniform(*window))
