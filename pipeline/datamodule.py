"""Face-crop frames of one protocol fold and task as Lightning dataloaders.

Splits are by whole subjects, read from a fold file that is leak-checked on every load (`pipeline.folds.read_folds`).
Each item carries its frame-table row number so that predictions can be mapped back to videos and subjects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler, get_worker_info

from pipeline.augment import DataConfigLike, build_eval_transform, build_train_transform, seed_transform
from pipeline.exclusions import usable_task_frames
from pipeline.folds import ROLES, fold_subjects, read_folds
from pipeline.parallel import available_cpus
from pipeline.tasks import CLASS_NAMES, Task

FRAME_TABLE_COLUMNS = ("subject_name", "sample_name", "class_name", "frame_index", "time_s", "crop_path")
ROW_INDEX_NAME = "frame_row"  # the frames(split) index: the row's 0-based data-row number in frames.csv
MAX_AUTO_WORKERS = 8


class FrameDataset(Dataset):
    """Frames of one split: (image CHW float tensor, label int64 tensor, frame-table row int64 tensor).

    Paths, labels and rows are kept as numpy arrays rather than a DataFrame: item lookup stays cheap, and forked
    dataloader workers do not copy the table page by page through Python reference counting.
    """

    def __init__(self, frames: pd.DataFrame, processed_dir: Path, transform: A.BaseCompose) -> None:
        missing = [column for column in ("crop_path", "label") if column not in frames.columns]
        if missing:
            raise ValueError(f"frame rows lack column(s) {missing}")
        self.processed_dir = Path(processed_dir)
        self.transform = transform
        self.crop_paths = np.array([str(self.processed_dir / path) for path in frames["crop_path"]], dtype=str)
        self.labels = frames["label"].to_numpy(dtype=np.int64)
        self.rows = frames.index.to_numpy(dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def read_image(self, item: int) -> np.ndarray:
        """The crop as HWC uint8 RGB; a missing or unreadable file is an error naming it and its row."""
        path = self.crop_paths[item]
        image = cv2.imread(path, cv2.IMREAD_COLOR)
        if image is None:
            reason = "missing" if not os.path.exists(path) else "unreadable"
            raise FileNotFoundError(
                f"cannot read face crop {path} ({reason}), frame-table row {self.rows[item]} (0-based)"
            )
        return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        image = self.transform(image=self.read_image(item))["image"]
        return image, torch.tensor(self.labels[item]), torch.tensor(self.rows[item])


def _seed_worker(worker_id: int) -> None:
    """Give each dataloader worker its own augmentation stream, derived from the loader's (seeded) base seed.

    Without this, forked workers would share one copied random state and draw identical augmentations.
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


class PainDataModule(pl.LightningDataModule):
    """Train / val / test frames of fold `fold` in `fold_file` for `task`, over the crops in `processed_dir`."""

    def __init__(
        self,
        processed_dir: Path,
        fold_file: Path,
        fold: int,
        task: Task,
        data_config: DataConfigLike,
        augment: Mapping[str, Any],
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int | None = None,
        balanced_sampling: bool = False,
        seed: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int = 4,
        frames_per_video: int | None = None,
        crop_fraction: float = 1.0,
        from_s: float | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or (eval_batch_size is not None and eval_batch_size < 1):
            raise ValueError(f"batch sizes must be >= 1, got {batch_size} / {eval_batch_size}")
        self.processed_dir = Path(processed_dir)
        self.fold_file = Path(fold_file)
        self.fold = int(fold)
        self.task = task
        self.data_config = data_config
        self.batch_size = batch_size
        # Evaluation keeps no activations for a backward pass, so twice the training batch fits.
        self.eval_batch_size = eval_batch_size or 2 * batch_size
        self.num_workers = default_num_workers() if num_workers is None else int(num_workers)
        self.balanced_sampling = balanced_sampling
        self.seed = seed
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.persistent_workers = persistent_workers and self.num_workers > 0
        self.prefetch_factor = prefetch_factor
        if frames_per_video is not None and frames_per_video < 1:
            raise ValueError(f"frames_per_video must be >= 1 or None, got {frames_per_video}")
        self.frames_per_video = frames_per_video
        if from_s is not None and from_s < 0:
            raise ValueError(f"from_s must be >= 0 or None, got {from_s}")
        self.from_s = from_s
        # Built now so that a bad augment config fails before any data is read.
        self.train_transform = build_train_transform(data_config, augment, crop_fraction)
        self.eval_transform = build_eval_transform(data_config, crop_fraction)
        seed_transform(self.train_transform, seed)  # the stream used when loading in the main process
        self._splits: dict[str, pd.DataFrame] | None = None
        self._datasets: dict[str, FrameDataset] = {}

    @property
    def frames_csv(self) -> Path:
        return self.processed_dir / "frames.csv"

    def setup(self, stage: str | None = None) -> None:
        """Read the frame table and the fold file once, and split the task's frames by the fold's subject roles."""
        if self._splits is not None:
            return
        table = self._read_frame_table()
        # The fold file may cover a subset of the preprocessed subjects (e.g. the 67 responders out of 87), so it is
        # checked on its own (roles, duplicates, leaks) and then must only name subjects that have frames.
        folds = read_folds(self.fold_file)
        roles = fold_subjects(folds, self.fold)
        subjects_with_frames = set(table["subject_name"])
        without_frames = sorted({s for members in roles.values() for s in members} - subjects_with_frames)
        if without_frames:
            raise ValueError(
                f"{self.fold_file}, fold {self.fold}: {len(without_frames)} subject(s) have no frames in "
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
                    f"{self.fold_file}, fold {self.fold}: role {role!r} has no frames of task "
                    f"{self.task.name} (classes {', '.join(self.task.classes)}); subjects: {roles[role]}"
                )
            splits[role] = rows
        self._splits = splits
        self._datasets = {
            role: FrameDataset(
                rows, self.processed_dir, self.train_transform if role == "train" else self.eval_transform
            )
            for role, rows in splits.items()
        }

    def _read_frame_table(self) -> pd.DataFrame:
        if not self.frames_csv.is_file():
            raise FileNotFoundError(f"frame table {self.frames_csv} not found (run preprocessing first)")
        text_columns = {"subject_name": str, "sample_name": str, "class_name": str, "crop_path": str}
        table = pd.read_csv(self.frames_csv, dtype=text_columns, keep_default_na=False)
        missing = [column for column in FRAME_TABLE_COLUMNS if column not in table.columns]
        if missing:
            raise ValueError(f"{self.frames_csv}: missing column(s) {missing}")
        if table.empty:
            raise ValueError(f"{self.frames_csv}: no frames")
        unknown = ~table["class_name"].isin(CLASS_NAMES)
        if unknown.any():
            row = int(np.flatnonzero(unknown.to_numpy())[0])
            raise ValueError(
                f"{self.frames_csv}, frame-table row {row} (0-based): "
                f"unknown class_name {table['class_name'].iloc[row]!r}"
            )
        table.index.name = ROW_INDEX_NAME
        return table

    def frames(self, split: str) -> pd.DataFrame:
        """Rows of `split` ("train" | "val" | "test") in dataset order, with their `label`; index = frame-table row."""
        if self._splits is None:
            raise RuntimeError("call setup() before frames()")
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(ROLES)}")
        return self._splits[split]

    def dataset(self, split: str) -> FrameDataset:
        self.frames(split)  # same checks
        return self._datasets[split]

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
        generator = torch.Generator().manual_seed(self.seed)
        # A last batch of a single image breaks batch norm in training; dropping the remainder costs < 1 batch.
        drop_last = len(self.dataset("train")) > self.batch_size
        if self.balanced_sampling:
            labels = self.dataset("train").labels
            weights = torch.as_tensor(class_balanced_weights(labels), dtype=torch.double)
            sampler = WeightedRandomSampler(weights, num_samples=len(labels), replacement=True, generator=generator)
            return self._loader("train", self.batch_size, sampler=sampler, generator=generator, drop_last=drop_last)
        return self._loader("train", self.batch_size, shuffle=True, generator=generator, drop_last=drop_last)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, shuffle=False)
