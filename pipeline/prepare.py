"""`make data` and `make aug-preview`: get a dataset from its raw layout to face crops and fold files."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from pipeline.biovid import SAMPLES_CSV, load_samples
from pipeline.cli import resolve_path
from pipeline.folds import biovid_subjects, make_folds, read_folds, subject_strata, write_folds
from pipeline.preprocess import PreprocessConfig, PreprocessResult, preprocess

log = logging.getLogger(__name__)


def dataset_root(cfg: DictConfig) -> Path:
    root = cfg.data.root
    if root is None:
        raise SystemExit("data.root is not set: for BioVid run `make data DATA=biovid BIOVID_ROOT=/path/to/PartA` "
                         "(the folder holding starting_point/samples.csv and video/)")
    return resolve_path(root)


def generate_synthetic(cfg: DictConfig, root: Path) -> None:
    """Write the synthetic twin into `root` (resumable: finished videos are kept)."""
    from pipeline.synthetic import PRESETS, generate

    options = OmegaConf.to_container(cfg.data.synthetic)
    preset, workers = options.pop("preset"), options.pop("workers")
    if preset not in PRESETS:
        raise SystemExit(f"unknown synthetic preset {preset!r}; known: {', '.join(PRESETS)}")
    config = dataclasses.replace(PRESETS[preset], **{k: v for k, v in options.items() if v is not None})
    log.info("synthetic twin: %s -> %s", config, root)
    generate(root, config, workers=workers)


def preprocess_config(cfg: DictConfig) -> PreprocessConfig:
    options = OmegaConf.to_container(cfg.preprocess)
    options.pop("workers")
    return PreprocessConfig(**options)


def fold_file_path(cfg: DictConfig) -> Path:
    return resolve_path(cfg.fold_file)


def read_fold_file(path: Path, subjects_with_frames: list[str]) -> pd.DataFrame:
    """Read and leak-check a fold file whose subjects must all have crops (it may cover a subset, e.g. 67 of 87)."""
    folds = read_folds(path)
    missing = sorted(set(folds.subject_name) - set(subjects_with_frames))
    if missing:
        raise SystemExit(f"{path}: {len(missing)} subject(s) of the fold file have no usable videos: "
                         f"{', '.join(missing)} (see failures.csv and the warnings above)")
    return folds


def ensure_folds(cfg: DictConfig, subjects: list[str]) -> Path:
    """Read (and leak-check) the fold file; the synthetic twin's is generated on first use, BioVid's is committed."""
    path = fold_file_path(cfg)
    if path.is_file():
        read_fold_file(path, subjects)
        return path
    if cfg.data.name != "synthetic":
        raise SystemExit(f"fold file {path} does not exist. BioVid's fold files are committed in data_manifests/; "
                         f"regenerate them with `python -m pipeline.folds write-biovid`")
    folds = make_folds(subjects, cfg.protocol.name, seed=cfg.protocol.seed, val_fraction=cfg.protocol.val_fraction,
                       test_fraction=cfg.protocol.test_fraction, strata=subject_strata(subjects))
    write_folds(folds, path)
    log.info("wrote fold file %s (%d folds over %d subjects)", path, folds.fold.nunique(), len(subjects))
    return path


def prepare_data(cfg: DictConfig, progress: bool = True) -> tuple[PreprocessResult, Path]:
    """Raw dataset -> validated sample table -> face crops + frame table -> checked fold file."""
    root = dataset_root(cfg)
    if cfg.data.name == "synthetic":
        generate_synthetic(cfg, root)
    # Every subject is cropped; the subject set only picks the fold file, so one frame table serves both sets.
    samples, report = load_samples(root, subject_set="all")
    log.info("%s: %d samples of %d subjects (%d skipped, %d unlisted videos ignored)", root / SAMPLES_CSV,
             len(samples), samples.subject_name.nunique(), report.n_skipped, len(report.unlisted_videos))
    if cfg.data.name == "biovid":
        expected = set(biovid_subjects(cfg.data.subject_set))
        missing = sorted(expected - set(samples.subject_name))
        if missing:
            log.warning("%d subject(s) of the %s set have no usable videos: %s", len(missing),
                        cfg.data.subject_set, ", ".join(missing))
    result = preprocess(samples, resolve_path(cfg.data.processed_dir), preprocess_config(cfg),
                        workers=cfg.preprocess.workers, progress=progress)
    log.info(result.summary())
    subjects = sorted(set(result.frames.subject_name))
    return result, ensure_folds(cfg, subjects)


def processed_frames(cfg: DictConfig) -> pd.DataFrame | None:
    """The frame table if the dataset has been prepared with the current settings, else None."""
    frames_csv = resolve_path(cfg.data.processed_dir) / "frames.csv"
    return pd.read_csv(frames_csv) if frames_csv.is_file() else None


def run_data(cfg: DictConfig) -> None:
    result, fold_file = prepare_data(cfg)
    print(f"data ready: {result.summary()}")
    print(f"frame table: {result.frames_csv}")
    print(f"fold file:   {fold_file}")


def run_aug_preview(cfg: DictConfig) -> None:
    """Write a PNG grid of training-augmented crops, as the model of `cfg.model` would see them."""
    from pipeline.augment import build_train_transform, save_augmentation_preview
    from pipeline.backbones import create_backbone

    frames = processed_frames(cfg)
    if frames is None:
        frames = prepare_data(cfg)[0].frames
    backbone, _ = create_backbone(cfg.model.name, pretrained=False, img_size=cfg.model.img_size)
    transform = build_train_transform(backbone.data_config, OmegaConf.to_container(cfg.augment),
                                      cfg.loader.crop_fraction)
    picks = frames.groupby("class_name", group_keys=False).apply(lambda g: g.sample(min(len(g), 2), random_state=0))
    paths = [resolve_path(cfg.data.processed_dir) / p for p in picks.crop_path]
    out = resolve_path(cfg.reports_dir) / f"aug_preview_{cfg.data.name}_{cfg.model.name}.png"
    save_augmentation_preview(paths, transform, backbone.data_config, out, n=4 * len(paths), seed=cfg.seed)
    print(f"augmentation preview: {out}")
