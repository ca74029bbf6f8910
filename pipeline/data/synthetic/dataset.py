"""Writing a whole twin into a folder: the config check and JSON, the videos (in parallel, resumable), the
ground-truth tables and samples.csv last, so that its presence means the dataset is complete."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from tqdm import tqdm

from pipeline.data.biovid import SAMPLES_COLUMNS, SAMPLES_CSV, VIDEO_DIR
from pipeline.data.synthetic.roster import Sample, Subject, make_samples, make_subjects
from pipeline.data.synthetic.settings import (
    CONFIG_JSON,
    EFFECT_SETTINGS,
    SAMPLE_TRUTH_CSV,
    SETTINGS_BEFORE_RECORDED,
    SUBJECTS_CSV,
    SyntheticConfig,
)
from pipeline.data.synthetic.videos import encode_video, face_regions, regions_path, remove_stale, video_is_complete
from pipeline.data.tasks import CLASS_NAMES
from pipeline.utils.atomic_io import SettingsMismatch, atomic_paths, atomic_write_text
from pipeline.utils.cpus import available_cpus, process_pool


def _write_video_job(job: tuple[Path, Path, SyntheticConfig, Subject, Sample, bool]) -> str:
    """Write a sample's regions table, and its video unless `video_done`: atomically, both in one flush."""
    video, regions, config, subject, sample, video_done = job
    paths = [*([] if video_done else [video]), *([] if regions.is_file() else [regions])]
    remove_stale(video)
    with atomic_paths(paths) as temporaries:
        for path, temporary in zip(paths, temporaries, strict=True):
            if path == video:
                encode_video(temporary, config, subject, sample)
            else:
                face_regions(config, subject, sample).to_csv(temporary, index=False)
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
        for key in ("au_weights", "skin", "hair", "iris", "background", "shirt", "resting_au"):
            row[key] = json.dumps(np.round(np.array(row[key], dtype=float), 2).tolist())
        rows.append(row)
    return pd.DataFrame(rows).round(4)


def _truth_table(subjects: list[Subject], samples: list[Sample]) -> pd.DataFrame:
    names = {s.subject_id: s.subject_name for s in subjects}
    return pd.DataFrame(
        [
            (names[s.subject_id], s.sample_name, CLASS_NAMES[s.class_id], s.intensity, s.onset_s, s.peak_s,
             s.burst_start_s, s.burst_locked)
            for s in samples
        ],
        columns=["subject_name", "sample_name", "class_name", "intensity", "onset_s", "peak_s", "burst_start_s",
                 "burst_locked"],
    ).round(4)


def _write_if_changed(path: Path, text: str) -> None:
    """Atomic write that leaves an identical file alone (a resumed run rewrites nothing)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    atomic_write_text(path, text)


def recorded_settings(config: SyntheticConfig) -> dict:
    """The config as synthetic_config.json records it: every field, except the effect settings when all of them are
    at their defaults (`EFFECT_SETTINGS`: a twin without planted effects reads as it did before they existed)."""
    settings = json.loads(json.dumps(dataclasses.asdict(config)))
    if all(settings[key] == value for key, value in EFFECT_SETTINGS.items()):
        settings = {key: value for key, value in settings.items() if key not in EFFECT_SETTINGS}
    return settings


def _check_config(root: Path, config: SyntheticConfig) -> str:
    """The config as JSON; refuses a folder written with another config, or one that is not a synthetic twin."""
    text = json.dumps(recorded_settings(config), indent=2, sort_keys=True) + "\n"
    path = root / CONFIG_JSON
    before = SETTINGS_BEFORE_RECORDED | EFFECT_SETTINGS
    found = before | json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    if not path.is_file() and ((root / SAMPLES_CSV).exists() or (root / VIDEO_DIR).exists()):
        raise ValueError(
            f"{root} holds a dataset but no {CONFIG_JSON}: not a synthetic twin (the real BioVid?), "
            f"refusing to write into it"
        )
    asked = before | json.loads(text)
    if found is not None and found != asked:
        changed = "; ".join(f"{key}: {found.get(key)!r} -> {asked.get(key)!r}"
                            for key in sorted(set(found) | set(asked)) if found.get(key) != asked.get(key))
        raise SettingsMismatch(
            f"{path} was written with other synthetic settings ({changed}). Delete this twin and its crops "
            f"(`make clean-data` deletes all of data/; or remove {root} and its processed folder), or generate "
            f"into other folders (data.root=... data.processed_dir=... data.manifest_dir=...)"
        )
    return text


def write_records(root: Path, config: SyntheticConfig) -> tuple[list[Subject], list[Sample]]:
    """The twin's config (checked against one already there) and its ground truth (subjects, samples) into `root`;
    returns the subjects and samples. What a twin is, with or without its videos (truth crops need none)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _write_if_changed(root / CONFIG_JSON, _check_config(root, config))
    subjects = make_subjects(config)
    samples = make_samples(config, subjects)
    _write_if_changed(root / SUBJECTS_CSV, _subjects_table(subjects).to_csv(index=False))
    _write_if_changed(root / SAMPLE_TRUTH_CSV, _truth_table(subjects, samples).to_csv(index=False))
    return subjects, samples


def generate(root: Path, config: SyntheticConfig, workers: int | None = None, progress: bool = True) -> pd.DataFrame:
    """Write the synthetic twin into `root` in BioVid Part A's layout and return its samples table.

    Resumable: videos already complete on disk are kept, and samples.csv is written last, so its presence means the
    dataset is complete. Also writes ground truth (synthetic_subjects.csv, synthetic_samples.csv, and per video the
    action units and PSPI regions of every frame under synthetic_regions/) and the config beside starting_point/.
    """
    root = Path(root)
    subjects, samples = write_records(root, config)
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
    table = samples_table(subjects, samples)
    _write_if_changed(root / SAMPLES_CSV, table.to_csv(sep="\t", index=False))
    return table
