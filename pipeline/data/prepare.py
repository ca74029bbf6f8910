"""`make data` and `make aug-preview`: get a dataset from its raw layout to face crops and fold files."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from pipeline.data.biovid import SAMPLES_CSV, load_samples
from pipeline.data.biovid_folds import BIOVID_MANIFEST_DIR, USABLE_SUFFIX, base_subject_set, biovid_subjects
from pipeline.data.face_crops import PreprocessConfig, PreprocessResult, preprocess
from pipeline.data.fold_checks import FoldError
from pipeline.data.fold_files import (
    check_fold_parameters,
    fold_parameters,
    make_folds,
    parameters_path,
    read_folds,
    subject_strata,
    write_folds,
)
from pipeline.utils.config_checks import UsageError
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)


def preprocess_config(preprocess: Mapping[str, Any]) -> PreprocessConfig:
    """How crops are made (the `preprocess` group, recorded in preprocess.json); not where or on how many cores
    (workers, device)."""
    options = OmegaConf.to_container(preprocess) if OmegaConf.is_config(preprocess) else dict(preprocess)
    for key in ("workers", "device"):
        options.pop(key)
    return PreprocessConfig(**options)


@dataclass(frozen=True)
class DataSettings:
    """What getting a dataset ready reads of the config (`make data`, and a CV, an embedding job or a preview that
    prepares it first), read once: the dataset, where its crops and fold file go, the fold protocol, how crops are
    made."""

    name: str  # data.name
    root: str | None  # data.root: the raw dataset (a twin's videos are written there)
    subject_set: str
    processed_dir: Path
    manifest_dir: Path  # data.manifest_dir: the fold files, and a committed subject list beside them
    fold_file: Path
    fold_parameters: dict  # the protocol's, as the fold file's sidecar records them
    preprocess: PreprocessConfig
    workers: int | None  # preprocess.workers
    device: str  # preprocess.device
    synthetic: dict | None  # data.synthetic, resolved: the twin's generator section (None: recordings on disk)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> DataSettings:
        protocol = cfg.protocol
        synthetic = OmegaConf.select(cfg, "data.synthetic", default=None)
        return cls(str(cfg.data.name), cfg.data.root, str(cfg.data.subject_set), resolve_path(cfg.data.processed_dir),
                   resolve_path(cfg.data.manifest_dir), resolve_path(cfg.fold_file),
                   fold_parameters(protocol.name, protocol.seed, protocol.val_fraction, protocol.get("test_fraction")),
                   preprocess_config(cfg.preprocess), cfg.preprocess.workers, cfg.preprocess.device,
                   None if synthetic is None else OmegaConf.to_container(synthetic, resolve=True))

    @property
    def twin(self) -> bool:
        """Whether the dataset is a synthetic twin this project generates (see `is_twin`)."""
        return self.synthetic is not None

    @property
    def committed_folds(self) -> bool:
        """Whether the fold files are BioVid's committed ones (read and checked, never written here): BioVid's, and
        the BioVid-scale twin's, which has Part A's people."""
        return self.fold_file.parent == BIOVID_MANIFEST_DIR


def dataset_root(name: str, root: str | None) -> Path:
    """Where dataset `name`'s raw videos are (`data.root`); unset, a UsageError that names BIOVID_ROOT."""
    if root is None:
        raise UsageError(f"BIOVID_ROOT is not set: DATA={name} reads its videos from the folder that holds "
                         "starting_point/samples.csv and video/, e.g. BIOVID_ROOT=/data/BioVid/PartA (data.root=)")
    return resolve_path(root)


def synthetic_config(section: Mapping[str, Any], **defaults: Any) -> Any:
    """The generator's `SyntheticConfig` of a config section shaped like `data.synthetic` (a preset, and fields that
    replace the preset's where they are not null; `workers` is not part of it). `defaults` fill fields the section
    lacks (the pretraining pool takes the twin's look)."""
    from pipeline.data.synthetic import PRESETS
    from pipeline.data.synthetic.settings import with_effect

    given = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)
    options = {**defaults, **given}
    preset, effect = options.pop("preset"), options.pop("effect", None)
    for key in ("workers", "crops", "classes"):  # where and how the twin is made, not what it is
        options.pop(key, None)
    if preset not in PRESETS:
        raise SystemExit(f"unknown synthetic preset {preset!r}; known: {', '.join(PRESETS)}")
    try:  # `effect=null` on a command line is YAML's null to Hydra: it names the null twin
        config = with_effect(PRESETS[preset], "null" if effect is None else str(effect))
        return dataclasses.replace(config, **{k: tuple(v) if isinstance(v, list) else v
                                              for k, v in options.items() if v is not None})
    except ValueError as error:
        raise SystemExit(f"data.synthetic: {error}") from None


def is_twin(data: Mapping[str, Any]) -> bool:
    """Whether the dataset of a `data` group is a synthetic twin this project generates (it has a `synthetic`
    generator section: DATA=synthetic, DATA=synthetic87), not recordings read from disk (BioVid)."""
    return data.get("synthetic") is not None


def generate_synthetic(data: DataSettings, root: Path) -> None:
    """Write the synthetic twin into `root` (resumable: finished videos are kept)."""
    from pipeline.data.synthetic import generate

    assert data.synthetic is not None
    config = synthetic_config(data.synthetic)
    log.info("synthetic twin: %s -> %s", config, root)
    generate(root, config, workers=data.synthetic["workers"])


def synthetic_fingerprint(root: Path) -> str:
    """`synthetic:<SHA-256 of the generator config>` of the synthetic videos written into `root`."""
    from pipeline.data.synthetic import CONFIG_JSON

    return "synthetic:" + hashlib.sha256((root / CONFIG_JSON).read_bytes()).hexdigest()


def source_fingerprint(data: DataSettings, root: Path) -> str | None:
    """What identifies the videos crops are made from: for the synthetic twin, the SHA-256 of the generator config
    it was written with (crops of another twin in the same processed folder are refused); None for BioVid."""
    return synthetic_fingerprint(root) if data.twin else None


def read_fold_file(path: Path, subjects_with_frames: list[str], remedy: str = "") -> pd.DataFrame:
    """Read and leak-check a fold file whose subjects must all have crops (it may cover a subset, e.g. 67 of 87)."""
    folds = read_folds(path)
    missing = sorted(set(folds.subject_name) - set(subjects_with_frames))
    if missing:
        raise SystemExit(f"{path}: {len(missing)} subject(s) of the fold file have no usable videos: "
                         f"{', '.join(missing)} (see failures.csv and the warnings above). {remedy}".rstrip())
    return folds


def usable_set_remedy(data: DataSettings) -> str:
    """How to go on when participants of the subject set have no crops: the `<set>_usable` subject set."""
    if data.subject_set.endswith(USABLE_SUFFIX) or (data.twin and not data.committed_folds):
        return ("The fold file was written when these participants still had crops; delete it and its .json sidecar "
                "to write it again over the participants that have crops now.")
    usable = f"{base_subject_set(data.subject_set)}{USABLE_SUFFIX}"
    manifest_dir = f"{data.processed_dir}/manifests"
    dataset = f" DATA={data.name}" + (f" BIOVID_ROOT={data.root}" if data.root else "")
    return (f"To go on without them, use the subject set of the participants that have crops: `make data{dataset} "
            f"ARGS=\"data.subject_set={usable} data.manifest_dir={manifest_dir}\"` (and the same ARGS for make cv and "
            f"make compare). Its fold file is written once into {manifest_dir} with the excluded participants and the "
            f"reason in its .json sidecar; its SHA-256 differs from the standard one, so `make compare` never mixes "
            f"the two (data_manifests/README.md).")


def exclusion_reasons(names: list[str], samples: pd.DataFrame, failures: pd.DataFrame) -> dict[str, str]:
    """Why each of `names` has no crops: its failed videos counted by reason, or that none of its videos is there."""
    reasons = {}
    for name in names:
        listed = int((samples.subject_name == name).sum())
        failed = failures[failures.subject_name == name]
        if not listed:
            reasons[name] = "no video of this participant is listed in samples.csv and present on disk"
            continue
        counts = failed.reason.value_counts()
        reasons[name] = (f"all {listed} video(s) failed: "
                         + "; ".join(f"{reason} ({count})" for reason, count in counts.items()))
    return reasons


def new_folds_remedy(data: DataSettings, path: Path) -> str:
    """How to get a fold file made with the config's parameters instead of the existing one."""
    if not data.committed_folds:
        return (f"Fold files are written once, then only read: to get folds with the config's parameters, delete "
                f"{path} and {parameters_path(path).name} (the next run writes them anew), or point "
                f"data.manifest_dir at another folder.")
    return ("BioVid's committed fold files stay as they are: to get folds with the config's parameters, point "
            "data.manifest_dir at another folder (e.g. data.manifest_dir=data/processed/biovid/manifests), where the "
            "next run writes new fold files.")


def ensure_folds(data: DataSettings, subjects: list[str], reasons: dict[str, str] | None = None) -> Path:
    """Read and check the fold file, or write it on first use with the config's protocol parameters.

    An existing file is leak-checked, must have been made with the config's protocol, seed and fractions (as
    recorded in its sidecar), and every participant in it must have crops (`subjects`). BioVid's files in
    data_manifests/biovid are committed, never written here; in another data.manifest_dir they are made over the
    whole subject set, like the committed ones, except for a `<set>_usable` subject set: the participants of <set>
    that have crops, the others recorded in the sidecar with the reason (`reasons`: name -> why it has no crops).
    The synthetic twin's fold files are made over the participants that have crops, the others recorded likewise.
    """
    path = data.fold_file
    parameters = data.fold_parameters
    usable_set = data.subject_set.endswith(USABLE_SUFFIX)
    if path.is_file():
        try:
            check_fold_parameters(path, parameters, new_folds_remedy(data, path))
        except FoldError as error:
            raise SystemExit(str(error)) from None
        read_fold_file(path, subjects, usable_set_remedy(data))
        return path
    if data.committed_folds:
        if usable_set:
            raise SystemExit(f"the {data.subject_set} fold files are not committed: point data.manifest_dir at "
                             f"another folder (e.g. data.manifest_dir={data.processed_dir}/manifests), where the "
                             f"first run writes them")
        raise SystemExit(f"fold file {path} does not exist. BioVid's fold files are committed in data_manifests/; "
                         f"regenerate them with `python -m pipeline fold-files write-biovid`")
    candidates = biovid_subjects(data.subject_set) if data.name == "biovid" else subjects
    without_frames = sorted(set(candidates) - set(subjects))
    if without_frames and not (usable_set or data.twin):
        raise SystemExit(f"cannot write {path}: {len(without_frames)} subject(s) of the {data.subject_set} set "
                         f"have no usable videos: {', '.join(without_frames)} (see failures.csv). "
                         f"{usable_set_remedy(data)}")
    names = sorted(set(candidates) & set(subjects))
    no_videos = "no video of this participant is listed in samples.csv and present on disk"
    excluded = {name: (reasons or {}).get(name, no_videos) for name in without_frames}
    folds = make_folds(names, **parameters, strata=subject_strata(names))  # exactly what the sidecar records
    write_folds(folds, path, parameters, excluded)
    log.info("wrote fold file %s (%d folds over %d subjects, %s)", path, folds.fold.nunique(), len(names),
             ", ".join(f"{key}={value}" for key, value in parameters.items()))
    for name, reason in excluded.items():
        log.warning("excluded from %s: %s (%s)", path.name, name, reason)
    return path


def truth_crops(data: DataSettings, root: Path, progress: bool) -> tuple[PreprocessResult, pd.DataFrame]:
    """A twin's crops from its own geometry (`data.synthetic.crops=truth`: no videos, no detector), of every class
    or of `data.synthetic.classes`; the samples table of the videos cropped."""
    from pipeline.data.synthetic.dataset import write_records
    from pipeline.data.synthetic.truth_crops import truth_preprocess, write_truth_crops

    assert data.synthetic is not None
    config = synthetic_config(data.synthetic)
    write_records(root, config)  # the config and ground truth, as a twin with videos has them
    classes = data.synthetic.get("classes")
    return write_truth_crops(config, truth_preprocess(data.preprocess), data.processed_dir,
                             synthetic_fingerprint(root), tuple(classes) if classes else None,
                             workers=data.synthetic["workers"], progress=progress)


def prepare_data(data: DataSettings, progress: bool = True) -> tuple[PreprocessResult, Path]:
    """Raw dataset -> validated sample table -> face crops + frame table -> checked fold file."""
    root = dataset_root(data.name, data.root)
    crops = (data.synthetic or {}).get("crops", "videos")
    if crops not in ("videos", "truth"):
        raise SystemExit(f"data.synthetic.crops={crops!r}: expected videos or truth")
    if data.twin and crops == "truth":
        result, samples = truth_crops(data, root, progress)
        log.info(result.summary())
        return result, ensure_folds(data, sorted(set(result.frames.subject_name)))
    if data.twin:
        generate_synthetic(data, root)
    # Every subject is cropped; the subject set only picks the fold file, so one frame table serves both sets.
    samples, report = load_samples(root, subject_set="all")
    log.info("%s: %d samples of %d subjects (%d skipped, %d unlisted videos ignored)", root / SAMPLES_CSV,
             len(samples), samples.subject_name.nunique(), report.n_skipped, len(report.unlisted_videos))
    if data.name == "biovid":
        expected = set(biovid_subjects(data.subject_set))
        missing = sorted(expected - set(samples.subject_name))
        if missing:
            log.warning("%d subject(s) of the %s set have no usable videos: %s", len(missing),
                        data.subject_set, ", ".join(missing))
    result = preprocess(samples, data.processed_dir, data.preprocess, workers=data.workers, progress=progress,
                        device=data.device, source=source_fingerprint(data, root))
    log.info(result.summary())
    subjects = sorted(set(result.frames.subject_name))
    without_crops = sorted(set(samples.subject_name) - set(subjects))
    return result, ensure_folds(data, subjects, exclusion_reasons(without_crops, samples, result.failures))


def processed_frames(data: DataSettings) -> pd.DataFrame | None:
    """The frame table if the dataset has been prepared with the current settings, else None."""
    frames_csv = data.processed_dir / "frames.csv"
    return pd.read_csv(frames_csv) if frames_csv.is_file() else None


def run_data(cfg: DictConfig) -> None:
    from pipeline.data.exclusions import exclusion_tables, format_tables, lost_share_warning

    data = DataSettings.from_config(cfg)
    result, fold_file = prepare_data(data)
    print(f"data ready: {result.summary()}")
    per_class, per_subject = exclusion_tables(result.frames, result.failures, data.preprocess.frames_per_video)
    print(format_tables(per_class, per_subject))
    warning = lost_share_warning(per_class)
    if warning:
        log.warning(warning)
    print(f"frame table: {result.frames_csv}")
    print(f"fold file:   {fold_file}")
