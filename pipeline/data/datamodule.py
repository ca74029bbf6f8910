"""Face-crop frames of one set of subject roles and a task as Lightning dataloaders.

Splits are by whole subjects: which subjects train, validate and test is data (`SubjectRoles`) handed to the one
DataModule: a fold of a fold file, leak-checked on every load (`SubjectRoles.of_fold`, `pipeline.data.fold_files.
read_folds`), the final model's split (its held-out subjects validate and test it), or a study's inner split (a
fold's test subjects left out: `validation_as_test`). Each item carries its frame-table row number so that
predictions can be mapped back to videos and subjects. With `clips=True` (a temporal head trained end to end) an
item is a whole video instead: its `loader.clip_frames` crops in time order under one augmentation draw
(`pipeline.data.clips.ClipDataset`), and its number indexes the split's video table (`prediction_rows`).

Training draws are keyed, not streamed: `EpochSampler` makes epoch k's order of crops and each crop's augmentation
seed from (seed, fold, k) alone (`pipeline.utils.seeds`), so a fold resumed from an epoch checkpoint sees the same
batches as one that never stopped, with any number of loader workers, persistent or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Sampler, get_worker_info

from pipeline.data.augment import DataConfigLike, build_eval_transform, build_train_transform, seed_transform
from pipeline.data.clips import ClipDataset, prediction_table
from pipeline.data.exclusions import usable_task_frames
from pipeline.data.fold_checks import ROLES
from pipeline.data.fold_files import fold_subjects, read_folds
from pipeline.data.frame_dataset import FrameDataset
from pipeline.data.tasks import CLASS_NAMES, Task
from pipeline.utils.cpus import available_cpus
from pipeline.utils.seeds import derived_seed

FRAME_TABLE_COLUMNS = ("subject_name", "sample_name", "class_name", "frame_index", "time_s", "crop_path")
ROW_INDEX_NAME = "frame_row"  # the frames(split) index: the row's 0-based data-row number in frames.csv
MAX_AUTO_WORKERS = 8


class EpochSampler(Sampler[tuple[int, int]]):
    """The training order of one epoch, with a seed per draw, both from (seed, stream, epoch) alone.

    Shuffles without replacement, or with `weights` draws with replacement in proportion to them (class-balanced
    sampling). Lightning calls `set_epoch` before every training epoch but the first of a fit, whose loader it
    iterates before it knows the epoch (a resumed fit included): that one is `epoch`, which the DataModule restores
    from the checkpoint. `drawn_epoch` is the epoch of the order last drawn, for the check that it is the trainer's.
    """

    def __init__(self, n_items: int, seed: int, stream: int, weights: np.ndarray | None = None,
                 epoch: int = 0) -> None:
        if n_items < 1:
            raise ValueError("EpochSampler needs at least one item")
        if weights is not None and (len(weights) != n_items or not np.all(np.asarray(weights) >= 0)):
            raise ValueError(f"weights must be {n_items} non-negative numbers")
        self.n_items, self.seed, self.stream = n_items, int(seed), int(stream)
        self.probabilities = None if weights is None else np.asarray(weights, dtype=float) / np.sum(weights)
        self.epoch = int(epoch)
        self.drawn_epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n_items

    def __iter__(self):
        order, draw_seeds = self.draw()
        return iter(zip(order.tolist(), draw_seeds.tolist(), strict=True))

    def draw(self) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's item order and each item's draw seed, as arrays (what iterating yields, pair by pair)."""
        self.drawn_epoch = self.epoch
        rng = np.random.default_rng(derived_seed(self.seed, self.stream, self.epoch))
        if self.probabilities is None:
            order = rng.permutation(self.n_items)
        else:
            order = rng.choice(self.n_items, size=self.n_items, replace=True, p=self.probabilities)
        draw_seeds = rng.integers(0, 2**63 - 1, size=self.n_items, dtype=np.int64)
        return order, draw_seeds


def _seed_worker(worker_id: int) -> None:
    """Give each dataloader worker its own augmentation stream, derived from the loader's base seed.

    Training items carry their own seeds (`EpochSampler`); this stream serves plain item numbers (previews, tools).
    """
    info = get_worker_info()
    cv2.setNumThreads(1)  # the workers are the parallelism; OpenCV's own threads would oversubscribe the CPUs
    if info is not None and hasattr(info.dataset, "transform"):
        seed_transform(info.dataset.transform, torch.initial_seed() % 2**32)


def default_num_workers() -> int:
    """Dataloader workers from the CPUs this process may use (its affinity mask, not the machine's count)."""
    return min(available_cpus(), MAX_AUTO_WORKERS)


def class_balanced_weights(labels: np.ndarray) -> np.ndarray:
    """Per-sample weight 1 / (frames of its class): every class gets the same expected share of draws."""
    counts = np.bincount(labels)
    return 1.0 / counts[labels]


def evenly_spaced_frames(frames: pd.DataFrame, per_video: int) -> pd.DataFrame:
    """Keep `per_video` crops of each video, evenly spread over its sampled frames (all of them if it has fewer).

    Lets a slow backbone train on fewer crops per clip without re-running the face-crop preprocessing.
    """
    ordered = frames.sort_values(["subject_name", "sample_name", "frame_index"])
    position = ordered.groupby(["subject_name", "sample_name"]).cumcount().to_numpy()
    count = ordered.groupby(["subject_name", "sample_name"])["frame_index"].transform("size").to_numpy()
    # the k-th kept crop of a video with n crops is at round(k * (n - 1) / (per_video - 1))
    keep = np.zeros(len(ordered), dtype=bool)
    for n in np.unique(count):
        wanted = np.unique(np.linspace(0, n - 1, min(per_video, n)).round().astype(int))
        keep |= (count == n) & np.isin(position, wanted)
    return ordered[keep].sort_index()


def frames_from(frames: pd.DataFrame, from_s: float, source: Path) -> pd.DataFrame:
    """Keep the crops taken at or after `from_s` seconds into their clip (the response builds up over the clip).

    A video left with no crop is an error naming it: the preprocessing window and this one do not overlap for it.
    """
    kept = frames[frames["time_s"] >= from_s]
    lost = sorted(set(frames["sample_name"]) - set(kept["sample_name"]))
    if lost:
        raise ValueError(
            f"{source}: {len(lost)} video(s) have no crop at or after loader.from_s={from_s} s (e.g. {lost[0]}); "
            f"lower from_s or re-run the preprocessing with a later preprocess.end_s"
        )
    return kept


@dataclass(frozen=True)
class LoaderConfig:
    """How a fold's crops are loaded: the `loader` config group as one typed object, checked once.

    The first seven fields have no defaults: their values live once, in configs/config.yaml's `loader` group
    (`from_config`; clip_frames has one, for configs saved before it). The last three are loader mechanics no config
    sets.
    """

    batch_size: int
    eval_batch_size: int | None  # None: 2 x batch_size
    num_workers: int | None  # None: from the CPUs this process may use
    balanced_sampling: bool
    frames_per_video: int | None  # None: every crop; k: k evenly spaced crops per video
    crop_fraction: float  # the central part of each face crop the model sees
    from_s: float | None  # None: every crop; t: only crops t seconds or later into the clip
    clip_frames: int = 8  # a temporal head's clip length (pipeline.data.clips)
    pin_memory: bool | None = None  # None: when a GPU is visible
    persistent_workers: bool = True
    prefetch_factor: int = 4

    def __post_init__(self) -> None:
        if self.batch_size < 1 or (self.eval_batch_size is not None and self.eval_batch_size < 1):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_size} / {self.eval_batch_size}")
        if self.frames_per_video is not None and self.frames_per_video < 1:
            raise ValueError(f"frames_per_video must be >= 1 or None, got {self.frames_per_video}")
        if self.from_s is not None and self.from_s < 0:
            raise ValueError(f"from_s must be >= 0 or None, got {self.from_s}")
        if self.clip_frames < 1:
            raise ValueError(f"clip_frames must be >= 1, got {self.clip_frames}")

    @classmethod
    def from_config(cls, loader: Mapping[str, Any], **changes: Any) -> LoaderConfig:
        """From the config's `loader` group (a DictConfig or a plain mapping), with `changes` on top."""
        names = {field.name for field in fields(cls)}
        values = {key: value for key, value in dict(loader).items() if key in names}
        unknown = sorted(set(dict(loader)) - names)
        if unknown:
            raise ValueError(f"unknown loader setting(s) {unknown}; known: {sorted(names)}")
        return cls(**{**values, **changes})


@dataclass(frozen=True)
class SubjectRoles:
    """Which subjects train, validate and test one model. `fold` names the random streams its training draws from
    (the fold's number; the final model's 0); `source` says where the roles come from, in messages."""

    train: tuple[str, ...]
    val: tuple[str, ...]
    test: tuple[str, ...]
    fold: int
    source: str

    @classmethod
    def of_fold(cls, fold_file: Path, fold: int) -> SubjectRoles:
        """Fold `fold` of a fold file, read and leak-checked."""
        roles = fold_subjects(read_folds(fold_file), fold)
        return cls(tuple(roles["train"]), tuple(roles["val"]), tuple(roles["test"]), int(fold),
                   f"{fold_file}, fold {fold}")

    def validation_as_test(self) -> SubjectRoles:
        """The same training and validation subjects, the validation subjects standing in as the test split: the
        other subjects' rows are never loaded (a study's inner split; the final model's held-out subjects)."""
        return replace(self, test=self.val)

    def as_dict(self) -> dict[str, list[str]]:
        return {role: list(getattr(self, role)) for role in ROLES}


_FRAME_TABLE: dict[tuple, pd.DataFrame] = {}  # the last frame table read in this process, by file identity


def read_frame_table(frames_csv: Path) -> pd.DataFrame:
    """The checked frame table of `frames_csv` (a copy the caller may change), its index the frame-table row.

    A process that sets up many folds of one dataset (a job worker fed a LOSO's folds) parses the file once: the last
    table read is kept under the file's identity (path, inode, size, modification time), so a rewritten file is read
    again."""
    status = frames_csv.stat()
    key = (str(frames_csv.resolve()), status.st_ino, status.st_size, status.st_mtime_ns)
    if key not in _FRAME_TABLE:
        table = _parse_frame_table(frames_csv)
        _FRAME_TABLE.clear()
        _FRAME_TABLE[key] = table
    return _FRAME_TABLE[key].copy()


def _parse_frame_table(frames_csv: Path) -> pd.DataFrame:
    text_columns = {"subject_name": str, "sample_name": str, "class_name": str, "crop_path": str}
    table = pd.read_csv(frames_csv, dtype=text_columns, keep_default_na=False)
    missing = [column for column in FRAME_TABLE_COLUMNS if column not in table.columns]
    if missing:
        raise ValueError(f"{frames_csv}: missing column(s) {missing}")
    if table.empty:
        raise ValueError(f"{frames_csv}: no frames")
    unknown = ~table["class_name"].isin(CLASS_NAMES)
    if unknown.any():
        row = int(np.flatnonzero(unknown.to_numpy())[0])
        raise ValueError(
            f"{frames_csv}, frame-table row {row} (0-based): "
            f"unknown class_name {table['class_name'].iloc[row]!r}"
        )
    table.index.name = ROW_INDEX_NAME
    return table


class PainDataModule(pl.LightningDataModule):
    """Train / val / test frames of the subjects' `roles` for `task`, over the crops in `processed_dir`."""

    def __init__(self, processed_dir: Path, roles: SubjectRoles, task: Task, data_config: DataConfigLike,
                 augment: Mapping[str, Any], loader: LoaderConfig, seed: int, clips: bool = False) -> None:
        super().__init__()
        self.clips = clips  # items are whole videos' clips (end-to-end clip training), not single crops
        self.processed_dir = Path(processed_dir)
        self.roles = roles
        self.fold = roles.fold
        self.task = task
        self.data_config = data_config
        self.loader = loader
        self.batch_size = loader.batch_size
        # Evaluation keeps no activations for a backward pass, so twice the training batch fits.
        self.eval_batch_size = loader.eval_batch_size or 2 * loader.batch_size
        self.num_workers = default_num_workers() if loader.num_workers is None else int(loader.num_workers)
        self.balanced_sampling = loader.balanced_sampling
        self.seed = seed
        self.pin_memory = torch.cuda.is_available() if loader.pin_memory is None else loader.pin_memory
        self.persistent_workers = loader.persistent_workers and self.num_workers > 0
        self.prefetch_factor = loader.prefetch_factor
        self.frames_per_video = loader.frames_per_video
        self.from_s = loader.from_s
        crop_fraction = loader.crop_fraction
        # Built now so that a bad augment config fails before any data is read.
        self.train_transform = build_train_transform(data_config, augment, crop_fraction)
        self.eval_transform = build_eval_transform(data_config, crop_fraction)
        seed_transform(self.train_transform, seed)  # the stream used when loading in the main process
        self._splits: dict[str, pd.DataFrame] | None = None
        self._datasets: dict[str, FrameDataset | ClipDataset] = {}
        self.first_epoch = 0  # the epoch this fit starts at: 0, or the one after a resumed checkpoint's

    def state_dict(self) -> dict[str, Any]:
        """Saved in every full checkpoint: the epoch a fit resumed from it starts at. Lightning writes the epoch
        checkpoints at the end of an epoch and resumes after it, and iterates the first epoch's loader before it has
        restored its loops, so the sampler must learn that epoch here, from the restored DataModule."""
        return {"next_epoch": self.trainer.current_epoch + 1} if self.trainer is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.first_epoch = int(state_dict.get("next_epoch", 0))

    @property
    def frames_csv(self) -> Path:
        return self.processed_dir / "frames.csv"

    def setup(self, stage: str | None = None) -> None:
        """Read the frame table and the fold file once, and split the task's frames by the fold's subject roles."""
        if self._splits is not None:
            return
        self._splits = self.split_frames()
        self._datasets = {role: self._dataset(rows, self.train_transform if role == "train" else self.eval_transform)
                          for role, rows in self._splits.items()}

    def split_frames(self) -> dict[str, pd.DataFrame]:
        """The task's frames of each role's subjects (the fold file's, checked against the frame table)."""
        table = self._read_frame_table()
        # The fold file may cover a subset of the preprocessed subjects (e.g. the 67 responders out of 87), so it is
        # checked on its own (roles, duplicates, leaks) and then must only name subjects that have frames.
        roles = self.roles.as_dict()
        subjects_with_frames = set(table["subject_name"])
        without_frames = sorted({s for members in roles.values() for s in members} - subjects_with_frames)
        if without_frames:
            raise ValueError(
                f"{self.roles.source}: {len(without_frames)} subject(s) have no frames in "
                f"{self.frames_csv}: {without_frames}"
            )
        task_frames = table[table["class_name"].isin(self.task.classes)].copy()
        task_frames["label"] = task_frames["class_name"].map(self.task.label_map()).astype(np.int64)
        task_frames = usable_task_frames(task_frames, self.task)
        if self.from_s is not None:
            task_frames = frames_from(task_frames, self.from_s, self.frames_csv)
        if self.frames_per_video is not None:
            task_frames = evenly_spaced_frames(task_frames, self.frames_per_video)
        splits = {}
        for role in ROLES:
            rows = task_frames[task_frames["subject_name"].isin(roles[role])]
            if rows.empty:
                raise ValueError(
                    f"{self.roles.source}: role {role!r} has no frames of task "
                    f"{self.task.name} (classes {', '.join(self.task.classes)}); subjects: {roles[role]}"
                )
            splits[role] = rows
        return splits

    def _dataset(self, rows: pd.DataFrame, transform) -> FrameDataset | ClipDataset:
        if self.clips:
            return ClipDataset(rows, self.processed_dir, transform, self.loader.clip_frames)
        return FrameDataset(rows, self.processed_dir, transform)

    def _read_frame_table(self) -> pd.DataFrame:
        if not self.frames_csv.is_file():
            raise FileNotFoundError(f"frame table {self.frames_csv} not found (run preprocessing first)")
        return read_frame_table(self.frames_csv)

    def frames(self, split: str) -> pd.DataFrame:
        """Rows of `split` ("train" | "val" | "test") in dataset order, with their `label`; index = frame-table row."""
        if self._splits is None:
            raise RuntimeError("call setup() before frames()")
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(ROLES)}")
        return self._splits[split]

    def dataset(self, split: str) -> FrameDataset | ClipDataset:
        self.frames(split)  # same checks
        return self._datasets[split]

    def prediction_rows(self, split: str) -> pd.DataFrame:
        """What the third element of a batch of `split` indexes: the frame rows (`frames(split)`, index = frame-table
        row), or for clips the split's videos (index = video number; `frames` = crops in the clip)."""
        dataset = self.dataset(split)
        return prediction_table(dataset.videos) if isinstance(dataset, ClipDataset) else self.frames(split)

    def protocol_metrics(self) -> dict[str, float]:
        """What a personalisation protocol cost each split (`EmbeddingDataModule`'s); none here."""
        return {}

    def split_summary(self) -> dict[str, dict[str, Any]]:
        """Per split: who (subject names), and how many subjects, videos, frames and frames per class."""
        summary = {}
        for split in ROLES:
            rows = self.frames(split)
            counts = rows["class_name"].value_counts()
            summary[split] = {
                "subjects": int(rows["subject_name"].nunique()),
                "videos": int(rows["sample_name"].nunique()),
                "frames": len(rows),
                "class_counts": {name: int(counts.get(name, 0)) for name in self.task.classes},
                "subject_names": sorted(rows["subject_name"].unique()),
            }
        return summary

    def _loader(self, split: str, batch_size: int, **sampling: Any) -> DataLoader:
        workers = self.num_workers
        return DataLoader(
            self.dataset(split),
            batch_size=batch_size,
            num_workers=workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            worker_init_fn=_seed_worker if workers > 0 else None,
            **sampling,
        )

    def train_dataloader(self) -> DataLoader:
        train = self.dataset("train")
        weights = class_balanced_weights(train.labels) if self.balanced_sampling else None
        sampler = EpochSampler(len(train), self.seed, stream=self.fold, weights=weights, epoch=self.first_epoch)
        # A last batch of a single image breaks batch norm in training; dropping the remainder costs < 1 batch.
        drop_last = len(train) > self.batch_size
        # the generator only seeds the workers' own streams (unused in training: every item carries its seed)
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader("train", self.batch_size, sampler=sampler, generator=generator, drop_last=drop_last)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, shuffle=False)
