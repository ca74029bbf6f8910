"""How pain plays out over a clip: per-frame action-unit intensities and head pose for one sample (the timing of
the response, blinks, fidgeting, and the hard look's head turns)."""

from __future__ import annotations

import math

import numpy as np

from pipeline.data.synthetic.roster import Sample, Subject
from pipeline.data.synthetic.settings import VIDEO_STREAM, SyntheticConfig, seeded_rng


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
    burst = _burst(config, sample, t)  # the temporal cue (zero where the twin plants none)
    au4 = w4 * (pain + burst) + fidget(0.15) + subject.resting_au[0]
    au67 = w67 * (pain + burst) + fidget(0.12) + subject.resting_au[1]
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


def _burst(config: SyntheticConfig, sample: Sample, t: np.ndarray) -> np.ndarray:
    """The temporal cue: a smooth bump of `burst_amplitude` over `burst_s` from the sample's burst start (zero where
    the twin plants none). The same bump in every video; only when it starts tells a pain video (`make_samples`)."""
    if sample.burst_start_s < 0:
        return np.zeros_like(t)
    phase = (t - sample.burst_start_s) / config.burst_s
    return config.burst_amplitude * np.where((phase >= 0) & (phase <= 1), np.sin(math.pi * phase) ** 2, 0.0)


def _hard_pose(config: SyntheticConfig, subject: Subject, sample: Sample, pose: np.ndarray,
               pain: np.ndarray) -> np.ndarray:
    """The hard look's head movement: a resting roll and yaw per video, more of both as pain grows (to one side per
    video), and the head pulled down a little; roll within +-20 degrees, yaw within +-25."""
    rng = seeded_rng(config.seed, VIDEO_STREAM, subject.subject_id, sample.number, 2)
    t = np.arange(config.n_frames) / config.fps
    sway = np.sin(2 * math.pi * rng.uniform(0.1, 0.4) * t + rng.uniform(0, 2 * math.pi))
    roll = rng.normal(0.0, 5.0) + 2.0 * sway + rng.choice([-1.0, 1.0]) * subject.roll_gain_deg * pain
    yaw = rng.normal(0.0, 7.0) + 3.0 * sway + rng.choice([-1.0, 1.0]) * subject.yaw_gain_deg * pain
    pose = pose.copy()
    pose[:, 1] += 0.08 * pain
    pose[:, 2] = np.radians(np.clip(roll, -20.0, 20.0))
    pose[:, 4] = np.radians(np.clip(yaw, -25.0, 25.0))
    return pose
