"""What a synthetic twin is made of and where it goes: the file names beside BioVid's layout, the config
(`SyntheticConfig`, `PRESETS`) and the seeded random streams every other module draws from, so that each result
depends only on (seed, subject, sample)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.data.tasks import CLASS_NAMES

SUBJECTS_CSV = "synthetic_subjects.csv"  # ground truth per subject, beside starting_point/ (not part of BioVid)
SAMPLE_TRUTH_CSV = "synthetic_samples.csv"  # ground truth per sample: response intensity and timing
CONFIG_JSON = "synthetic_config.json"  # the config the folder was written with; resuming with another one refuses
REGIONS_DIR = "synthetic_regions"  # per video: action units, pose and PSPI regions per frame (not part of BioVid)
REGIONS = ("brows", "orbits", "nose_lip", "eyes")  # where AU4, AU6/7, AU9/10 and AU43 show
DIFFICULTIES = ("classic", "hard")
# Settings added after twins were first written, with the value those twins were written with.
SETTINGS_BEFORE_RECORDED = {"difficulty": "classic"}

# Seed-sequence stream tags: independent random streams for the roster, each subject's look and each video.
ROSTER_STREAM, SUBJECT_STREAM, VIDEO_STREAM = 101, 202, 303


def seeded_rng(*keys: int) -> np.random.Generator:
    """An independent random stream for its keys (seed, stream tag, subject, sample, part)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in keys]))


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
