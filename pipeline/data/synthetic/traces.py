"""A twin's facial activity over time without a single frame drawn: per clip, the per-frame action units and head
pose the generator animates (`animate`), the truth a facial tracker would estimate from its video.

The same animation the videos are rendered from and `synthetic_regions/` records (equal to its two
decimals), so the reference instrument of `make fidelity` reads the twin's own truth; all 8,700 clips of the
BioVid-scale twin take seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.data.synthetic.animation import animate
from pipeline.data.synthetic.roster import make_samples, make_subjects
from pipeline.data.synthetic.settings import VIDEO_STREAM, SyntheticConfig, seeded_rng

# The tracked signals, in the order of `ClipTraces.values`' last axis: the four PSPI action units (intensity 0..1),
# head roll and yaw (degrees) and the head's vertical position (face half-widths, downwards positive).
CHANNELS = ("au4", "au6_7", "au9_10", "au43", "roll_deg", "yaw_deg", "head_dy")


@dataclass(frozen=True)
class ClipTraces:
    """Every clip's signals (clips x frames x `CHANNELS`) with its person and class."""

    values: np.ndarray
    subject_names: np.ndarray
    class_ids: np.ndarray
    sample_names: np.ndarray
    fps: int


def clip_traces(config: SyntheticConfig) -> ClipTraces:
    """The twin's clips in samples.csv order, each as the generator animates it (deterministic from the config)."""
    subjects = make_subjects(config)
    samples = make_samples(config, subjects)
    values = np.empty((len(samples), config.n_frames, len(CHANNELS)), dtype=np.float32)
    for index, sample in enumerate(samples):
        rng = seeded_rng(config.seed, VIDEO_STREAM, sample.subject_id, sample.number, 1)
        action_units, pose = animate(config, subjects[sample.subject_id], sample, rng)
        values[index, :, :4] = action_units
        values[index, :, 4] = np.degrees(pose[:, 2])
        values[index, :, 5] = np.degrees(pose[:, 4])
        values[index, :, 6] = pose[:, 1]
    names = {subject.subject_id: subject.subject_name for subject in subjects}
    return ClipTraces(values=values, subject_names=np.array([names[s.subject_id] for s in samples]),
                      class_ids=np.array([s.class_id for s in samples]),
                      sample_names=np.array([s.sample_name for s in samples]), fps=config.fps)
