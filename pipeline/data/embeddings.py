"""A fold's crops as a frozen backbone's embeddings: the same splits, order and keyed draws as `PainDataModule`, with
no image read.

`EmbeddingTable` holds the per-crop embeddings of the frame table's rows (the plain one, from the evaluation
transform, and optionally K augmented views per crop); `pipeline.models.embedding_cache` computes, stores and checks
them. `EmbeddingDataModule` splits the fold exactly as `PainDataModule` does (it is one) and serves
(embedding, label, row) items: validation and test get the plain embedding; training gets the plain one, or with K
views the view chosen by the draw seed `EpochSampler` gives each crop, so epochs see different augmentations keyed
by (seed, fold, epoch) as image training does.

A personalisation protocol (`personalise.mode`, pipeline/data/personalise.py) is applied here, per split, so a person
is only ever seen against their own statistics: `subject_normalised` standardises each person's embeddings (plain and
views) by the mean and spread of that person's plain embeddings in the split; `baseline` takes k of each person's BL1
videos out of the split as their reference and serves every other crop minus the reference's mean plain embedding. A
training person's reference comes from their training videos, a test person's from their test videos; the videos a
split lost are in `protocol_metrics` and `split_summary`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from pipeline.data.datamodule import ROLES, LoaderConfig, PainDataModule, SubjectRoles
from pipeline.data.personalise import (
    VIDEO_KEYS,
    PersonaliseConfig,
)


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

    def transform(self, change) -> None:
        """Replace the plain embeddings and every view by `change(features (N, D)) -> (N, D)`, row for row."""
        self.plain = torch.from_numpy(np.asarray(change(self.plain.numpy()), dtype=np.float32))
        if self.views is not None:
            self.views = torch.stack([torch.from_numpy(np.asarray(change(view.numpy()), dtype=np.float32))
                                      for view in self.views])


class EmbeddingDataModule(PainDataModule):
    """`PainDataModule` over cached embeddings: the same splits, training order and draw seeds; no image is read.

    The embeddings live in memory, so loading runs in the main process (no workers)."""

    def __init__(self, processed_dir: Path, roles: SubjectRoles, task, data_config, augment: Any,
                 loader: LoaderConfig, seed: int, *, embeddings: EmbeddingTable, source: Path,
                 personalise: PersonaliseConfig) -> None:
        super().__init__(processed_dir, roles, task, data_config, augment, loader, seed)
        self.embeddings, self.source = embeddings, Path(source)
        self.personalise = personalise
        self.num_workers, self.persistent_workers, self.pin_memory = 0, False, False
        self.references: dict[str, pd.DataFrame] = {}  # baseline: per split, the reference crops taken out of it

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        self._splits = self.split_frames()  # no image dataset is built: the items are embeddings
        protocol = self.personalise.protocol
        for role in ROLES:  # a protocol that reads a person's reference videos takes them out of the split
            taken = protocol.take_reference(self._splits[role], self.personalise)
            if taken is not None:
                self._splits[role], self.references[role] = taken
        self._datasets = {role: EmbeddingDataset(rows, self.embeddings, self.source, augmented=role == "train")
                          for role, rows in self._splits.items()}
        for role, dataset in self._datasets.items():
            self._personalise(role, dataset)

    def _personalise(self, role: str, dataset: EmbeddingDataset) -> None:
        """The split's embeddings as the protocol shows them to the head (`Protocol.split_transform`)."""
        protocol = self.personalise.protocol
        if not protocol.personal:
            return
        subjects = self._splits[role]["subject_name"].to_numpy(dtype=str) if self._splits else np.array([])
        reference = self.references.get(role)
        reference_subjects, reference_features = np.array([], dtype=str), self.embeddings.plain[:0]
        if reference is not None:
            positions = self.embeddings.positions(reference.index.to_numpy(dtype=np.int64), self.source)
            reference_subjects, reference_features = (reference["subject_name"].to_numpy(dtype=str),
                                                      self.embeddings.plain[positions])
        change = protocol.split_transform(subjects, dataset.plain.numpy(), reference_subjects, reference_features)
        if change is not None:
            dataset.transform(change)

    def protocol_metrics(self) -> dict[str, float]:
        """What the personalisation protocol cost each split: its reference videos and the videos left."""
        if not self.references:
            return {}
        out = {}
        for role in ROLES:
            for name, rows in (("reference_videos", self.references[role]), ("videos", self.frames(role))):
                out[f"personalise/{role}_{name}"] = float(len(rows[VIDEO_KEYS].drop_duplicates()))
        return out

    def split_summary(self) -> dict[str, dict[str, Any]]:
        summary = super().split_summary()
        for role, reference in self.references.items():
            summary[role]["reference_videos"] = sorted(
                f"{subject}/{sample}" for subject, sample in reference[VIDEO_KEYS]
                .drop_duplicates().itertuples(index=False))
        return summary
