"""`FrameDataset`: the face crops of one split as tensors, each with its label and frame-table row.

The single-crop dataset of frame models (`pipeline.data.datamodule`), and what a clip (`pipeline.data.clips`), the
embedding cache and the pretraining pool read their crops through.
"""

from __future__ import annotations

import os
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from pipeline.data.augment import seed_transform


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

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`key` is an item number, or (item, augmentation seed) as `EpochSampler` yields them: the seed then fixes
        this crop's random augmentation, whichever worker process draws it."""
        item, draw_seed = key if isinstance(key, tuple) else (key, None)
        if draw_seed is not None:
            seed_transform(self.transform, draw_seed)
        image = self.transform(image=self.read_image(item))["image"]
        return image, torch.tensor(self.labels[item]), torch.tensor(self.rows[item])
