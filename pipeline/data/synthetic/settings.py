"""What a synthetic twin is made of and where it goes: the file names beside BioVid's layout, the config
(`SyntheticConfig`, `PRESETS`) and the seeded random streams every other module draws from, so that each result
depends only on (seed, subject, sample)."""

from __future__ import annotations

import dataclasses
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
# Settings of the BioVid-scale twin and the planted effects: recorded only where one of them is not its default, so a
# twin written before they existed keeps its synthetic_config.json byte for byte (its crops stay valid).
EFFECT_SETTINGS = {"roster": "drawn", "burst_amplitude": 0.0, "burst_s": 0.8, "burst_pain_window_s": [2.3, 2.7],
                   "burst_rest_window_s": [2.0, 4.7], "resting_au_sd": 0.0, "effect": "pain",
                   "response_probability": None}

ROSTERS = ("drawn", "biovid")  # who the subjects are: names drawn from the seed, or Part A's 87 names
# Seed-sequence stream tags: independent random streams for the roster, each subject's look and each video.
ROSTER_STREAM, SUBJECT_STREAM, VIDEO_STREAM = 101, 202, 303
# Part streams of one video (seeded_rng(seed, VIDEO_STREAM, subject, number, part)): each planted effect draws from a
# stream of its own, so a twin without it is drawn exactly as before it existed.
BURST_PART = 3


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
    # The share of a responder's clips of each class (BL1..PA4) that show the response, where it grows with the
    # stimulus as on BioVid (facial responses are rare at the pain threshold); the other clips show none at all. It
    # replaces missed_response_probability (None: every class shows it in 1 - missed_response_probability of the
    # clips, the others a trace of it). A missed clip's temporal-cue burst is not locked to the stimulus either.
    response_probability: tuple[float, ...] | None = None
    onset_s: tuple[float, float] = (1.8, 2.6)  # the response starts in this window (uniform)
    peak_s: tuple[float, float] = (3.5, 5.0)  # and reaches its peak in this one
    blink_rate_hz: float = 0.3  # spontaneous blinks, in every class
    noise_sigma: float = 2.0  # sensor noise, grey levels
    render_max_side: int = 480  # frames are drawn at most this large and upscaled (cheap full-resolution output)
    fourcc: str = "mp4v"
    difficulty: str = "classic"  # classic: frontal faces Haar finds | hard: what real faces do to a detector
    roster: str = "drawn"  # drawn: BioVid-style names from the seed | biovid: Part A's 87 names, its 20 non-responders
    # Planted effects (the effect bundles below), each with its true size, recorded in synthetic_config.json:
    # - the temporal cue: one burst of brow lowering and orbit tightening (AU4, AU6/7) of this peak in every video,
    #   lasting burst_s; in a responder's pain video it starts within burst_pain_window_s (locked to the stimulus),
    #   in every other video at a time drawn over burst_rest_window_s. Every video shows the same burst, so a single
    #   crop cannot tell the classes apart: only when it happens does (a frame mean has nothing to see).
    burst_amplitude: float = 0.0
    burst_s: float = 0.8
    burst_pain_window_s: tuple[float, float] = (2.3, 2.7)
    burst_rest_window_s: tuple[float, float] = (2.0, 4.7)
    # - the person baseline: each person's resting face holds brow lowering and orbit tightening of their own (an
    #   offset drawn per person, |N(0, sd)| AU units, in every video of theirs), so the level that means pain differs
    #   between people and a model that knows the person's resting recordings can tell more.
    resting_au_sd: float = 0.0
    effect: str = "pain"  # the name of the bundle the planted sizes came from (EFFECTS), for the record

    def __post_init__(self) -> None:
        if self.n_subjects < 1 or self.samples_per_class < 1:
            raise ValueError("need at least one subject and one sample per class")
        if self.width < 64 or self.height < 48 or self.width % 2 or self.height % 2:
            raise ValueError(f"frame size must be even and at least 64 x 48, got {self.width} x {self.height}")
        if len(self.class_intensity) != len(CLASS_NAMES):
            raise ValueError(f"class_intensity needs one value per class {CLASS_NAMES}")
        if self.response_probability is not None and (len(self.response_probability) != len(CLASS_NAMES) or not all(
                0.0 <= p <= 1.0 for p in self.response_probability)):
            raise ValueError(f"response_probability needs one share in [0, 1] per class {CLASS_NAMES}")
        if not 0.0 <= self.non_responder_fraction <= 1.0:
            raise ValueError(f"non_responder_fraction must be in [0, 1], got {self.non_responder_fraction}")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {self.difficulty!r}")
        if 5 * self.samples_per_class > 999:
            raise ValueError("sample running numbers have three digits: at most 199 samples per class")
        if self.roster not in ROSTERS:
            raise ValueError(f"roster must be one of {ROSTERS}, got {self.roster!r}")
        if self.roster == "biovid" and self.n_subjects != BIOVID_SUBJECTS:
            raise ValueError(f"the biovid roster holds Part A's {BIOVID_SUBJECTS} people, not {self.n_subjects}")
        if self.burst_amplitude < 0 or self.resting_au_sd < 0 or self.burst_s <= 0:
            raise ValueError("burst_amplitude and resting_au_sd must be >= 0 and burst_s > 0")
        for name in ("burst_pain_window_s", "burst_rest_window_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high or high + self.burst_s > self.duration_s:
                raise ValueError(f"{name}={low, high}: the burst must start and end inside the {self.duration_s} s "
                                 f"clip")

    @property
    def n_frames(self) -> int:
        return math.floor(self.fps * self.duration_s + 0.5)


BIOVID_SUBJECTS = 87
PRESETS: dict[str, SyntheticConfig] = {
    "tiny": SyntheticConfig(n_subjects=5, samples_per_class=2, width=160, height=120),
    "default": SyntheticConfig(n_subjects=20, samples_per_class=6, width=320, height=240),
    "full": SyntheticConfig(n_subjects=87, samples_per_class=20, width=1388, height=1038),
    # BioVid's people (names, the 20 non-responders) and Part A's 20 clips a class, so Part A's committed fold files
    # apply and a person's accuracy has Part A's binomial spread. Calibrated: the share of a responder's clips that
    # show a response, per class, makes the reference method of `make fidelity` reproduce its published BioVid
    # figures (LOSO over the 87: 53.4, 56.0, 64.3, 72.5 % for BL1 vs PA1..PA4 against 53.3, 56.0, 64.0, 72.4; five
    # classes, held out of the fit, 29.8 against 30.8), found by scripts/calibrate_twin.py under the `all` effect
    "biovid87": SyntheticConfig(n_subjects=BIOVID_SUBJECTS, samples_per_class=20, width=320, height=240,
                                roster="biovid", response_probability=(0.0, 0.1328, 0.2109, 0.3828, 0.6016)),
}
NO_RESPONSE = (0.0,) * len(CLASS_NAMES)
# Planted effects, bundled: each a set of generator settings whose sizes are known (data.synthetic.effect). `all` is the
# BioVid-scale twin's default; each of the others carries one effect alone (and `null` none: the classes look alike),
# for measuring a comparison's error rates (`make power`).
EFFECTS: dict[str, dict] = {
    "pain": {},  # the generator's own settings: the graded PSPI response alone (every twin before effects)
    "all": {"burst_amplitude": 0.5, "resting_au_sd": 0.15},
    "null": {"class_intensity": NO_RESPONSE},
    "temporal": {"class_intensity": NO_RESPONSE, "burst_amplitude": 0.6, "response_probability": None},
    "baseline": {"resting_au_sd": 0.25},
    "graded": {"class_intensity": (0.0, 0.25, 0.5, 0.75, 1.0)},
}


def with_effect(config: SyntheticConfig, effect: str) -> SyntheticConfig:
    """`config` with the planted sizes of an effect bundle (EFFECTS) and its name."""
    if effect not in EFFECTS:
        raise ValueError(f"unknown synthetic effect {effect!r}; known: {', '.join(EFFECTS)}")
    return dataclasses.replace(config, **EFFECTS[effect], effect=effect)
