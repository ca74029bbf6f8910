"""A fold's crops as a frozen backbone's embeddings: the same splits, order and keyed draws as `PainDataModule`, with
no image read.

`EmbeddingTable` holds the per-crop embeddings of the frame table's rows (the plain one, from the evaluation
transform, and optionally K augmented views per crop); `pipeline.models.embedding_cache` computes, stores and checks
them. `EmbeddingDataModule` splits the fold exactly as `PainDataModule` does (it is one) and serves
(embedding, label, row) items: validation and test get the plain embedding; training gets the plain one, or with K
views the view chosen by the draw seed `EpochSampler` gives each crop, so epochs see different augmentations keyed
by (seed, fold, epoch) as image training does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from pipeline.data.datamodule import LoaderConfig, PainDataModule


@dataclass(frozen=True)
class EmbeddingTable:
    """Embeddings of frame-table rows: `plain` (N, D) from the evaluation transform, `views` (K, N, D) augmented."""

    rows: np.ndarray  # (N,) int64, frame-table row numbers (frames.csv data rows, 0-based)
    plain: np.ndarray  # (N, D) float32
    views: np.ndarray  # (K, N, D) float32; K = 0: none

    def positions(self, rows: np.ndarray, source: Path) -> np.ndarray:
        """Where each of `rows` sits in the table; a row without an embedding is an error naming it."""
        order = np.argsort(self.rows)
        found = np.searchsorted(self.rows, rows, sorter=order)
        found = np.minimum(found, len(self.rows) - 1)
        positions = order[found]
        missing = rows[self.rows[positions] != rows]
        if len(missing):
            raise ValueError(f"{source}: no embedding for frame-table row {int(missing[0])} (0-based) and "
                             f"{len(missing) - 1} more; the cache was built for other rows (loader.from_s or "
                             f"loader.frames_per_video changed?)")
        return positions


class EmbeddingDataset(Dataset):
    """(embedding float tensor (D,), label int64 tensor, frame-table row int64 tensor) for the frames of one split."""

    def __init__(self, frames: pd.DataFrame, table: EmbeddingTable, source: Path, augmented: bool) -> None:
        self.rows = frames.index.to_numpy(dtype=np.int64)
        self.labels = frames["label"].to_numpy(dtype=np.int64)
        positions = table.positions(self.rows, source)
        self.plain = torch.from_numpy(np.ascontiguousarray(table.plain[positions]))
        self.views = (torch.from_numpy(np.ascontiguousarray(table.views[:, positions]))
                      if augmented and len(table.views) else None)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        item, draw_seed = key if isinstance(key, tuple) else (key, None)
        if self.views is not None and draw_seed is not None:
            embedding = self.views[int(draw_seed) % len(self.views), item]
        else:
            embedding = self.plain[item]
        return embedding, torch.tensor(self.labels[item]), torch.tensor(self.rows[item])


class EmbeddingDataModule(PainDataModule):
    """`PainDataModule` over cached embeddings: the same splits, training order and draw seeds; no image is read.

    The embeddings live in memory, so loading runs in the main process (no workers)."""

    def __init__(self, processed_dir: Path, fold_file: Path, fold: int, task, data_config, augment: Any,
                 loader: LoaderConfig, seed: int = 0, *, embeddings: EmbeddingTable, source: Path) -> None:
        super().__init__(processed_dir, fold_file, fold, task, data_config, augment, loader, seed=seed)
        self.embeddings, self.source = embeddings, Path(source)
        self.num_workers, self.persistent_workers, self.pin_memory = 0, False, False

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        super().setup(stage)
        assert self._splits is not None
        self._datasets = {role: EmbeddingDataset(rows, self.embeddings, self.source, augmented=role == "train")
                          for role, rows in self._splits.items()}
